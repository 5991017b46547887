"""PPO's clipped surrogate, with asymmetric clipping and dual clip.

Schulman et al., "Proximal Policy Optimization Algorithms" (arXiv 1707.06347), Eq. 7, per token with
r = pi_theta / pi_old:

    L = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))

``clip_high > clip_low`` is DAPO's clip-higher (Yu et al., arXiv 2503.14476). Dual clip (Ye et al.,
"Mastering Complex Control in MOBA Games with Deep RL", arXiv 1912.09729) bounds the loss of tokens with
negative advantage: ``L = min(L, -A * clip_c)`` where A < 0. verl's ``vanilla`` loss.
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossOutput,
    clipped_surrogate,
    log_ratio,
)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(inp: PolicyLossInputs) -> PolicyLossOutput:
    ratio = torch.exp(log_ratio(inp))
    loss, clipped, lower = clipped_surrogate(ratio, inp.advantages, inp.clip_low, inp.clip_high, inp.clip_c)
    return PolicyLossOutput(loss, clipped, clipped_lower=lower)
