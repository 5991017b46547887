"""CISPO: clipped importance-sampling-weight policy optimisation.

MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (arXiv 2506.13585),
Eq. 4: clip the importance weight, not the update, and stop its gradient, so no token is ever dropped:

    L = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log pi_theta        (r = pi_theta / pi_old)

verl's ``cispo``.
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.losses import POLICY_LOSSES, PolicyLossInputs, PolicyLossOutput, log_ratio


@POLICY_LOSSES.register("cispo")
def cispo(inp: PolicyLossInputs) -> PolicyLossOutput:
    ratio = torch.exp(log_ratio(inp))
    clipped_ratio = torch.clamp(ratio, 1.0 - inp.clip_low, 1.0 + inp.clip_high)
    loss = -clipped_ratio.detach() * inp.advantages * inp.logp
    return PolicyLossOutput(loss, (ratio != clipped_ratio).float())
