"""GAE: generalised advantage estimation with a learned critic.

Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(arXiv 1506.02438), Eq. 16, over each sample's policy tokens with the outcome reward on the last one:

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          (V and A after the last token are 0)
    returns = A + V                                     (the critic's regression target)

Tokens outside the loss mask (tool output) are skipped: they neither produce a TD error nor break the
recursion (verl's ``compute_gae_advantage_return``). Advantages are then whitened over the batch's policy
tokens; returns are not. ``values`` come from a value-head engine (``FSDPEngine(..., value_head=True)``)
and are aligned like log-probabilities (``values[t]`` is the critic's estimate before token t).
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    AdvantageOutput,
    last_token_rewards,
)
from slipstream.trainer.algos.segments import from_padded, masked_whiten, to_padded


@ADVANTAGES.register("gae")
def gae(inp: AdvantageInputs) -> AdvantageOutput:
    if inp.values is None:
        raise ValueError("adv_estimator `gae` needs critic values: run the trainer with a value-head engine")
    rew = to_padded(last_token_rewards(inp).float(), inp.cu_seqlens)
    val = to_padded(inp.values.float().detach(), inp.cu_seqlens)
    mask = to_padded(inp.loss_mask.float(), inp.cu_seqlens)
    n, width = rew.shape
    next_value = torch.zeros(n, dtype=rew.dtype, device=rew.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(rew)
    for t in reversed(range(width)):
        delta = rew[:, t] + inp.gamma * next_value - val[:, t]
        candidate = delta + inp.gamma * inp.lam * last_gae
        m = mask[:, t]
        next_value = val[:, t] * m + (1 - m) * next_value
        last_gae = candidate * m + (1 - m) * last_gae
        adv[:, t] = last_gae
    advantages = from_padded(adv, inp.cu_seqlens) * inp.loss_mask.float()
    returns = advantages + inp.values.float().detach() * inp.loss_mask.float()
    return AdvantageOutput(masked_whiten(advantages, inp.loss_mask) * inp.loss_mask.float(), returns)
