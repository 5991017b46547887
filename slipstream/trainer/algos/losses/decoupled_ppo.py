"""Decoupled PPO: separate behaviour and proximal policies (AReaL).

Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning"
(arXiv 2505.24298), Eq. 5. Tokens were sampled by pi_behav (possibly several stale versions); the trust
region is centred on pi_prox (the trainer's weights at the start of this step, recomputed):

    w = pi_prox / pi_behav                      (behaviour importance weight, no gradient)
    r = pi_theta / pi_prox
    L = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))      (+ dual clip when clip_c is set)

As AReaL's ``behav_imp_weight_cap``: tokens with w > cap are dropped (weight 0), not clamped.
``old_logp`` must be the proximal logprobs and ``behav_logp`` the behaviour ones.
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.losses import (
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossOutput,
    clipped_surrogate,
    log_ratio,
)


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(inp: PolicyLossInputs) -> PolicyLossOutput:
    if inp.behav_logp is None:
        raise ValueError(
            "policy_loss `decoupled_ppo` needs behaviour logprobs and recomputed proximal logprobs"
        )
    ratio = torch.exp(log_ratio(inp))
    loss, clipped, lower = clipped_surrogate(ratio, inp.advantages, inp.clip_low, inp.clip_high, inp.clip_c)
    behav_log_w = torch.clamp(inp.old_logp - inp.behav_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND).detach()
    weight = torch.exp(behav_log_w)
    if inp.behav_cap is not None:
        weight = torch.where(weight <= inp.behav_cap, weight, torch.zeros_like(weight))
    return PolicyLossOutput(loss * weight, clipped, weight=weight, clipped_lower=lower)
