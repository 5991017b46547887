"""RLOO: REINFORCE with a leave-one-out baseline.

Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs" (arXiv 2402.14740), Eq. 5 (Kool et al. 2019): for n > 1 samples of one prompt,

    A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean(r))

broadcast to every policy token. As verl's ``rloo``, a group of one sample has no baseline (A_i = r_i).
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    AdvantageOutput,
    broadcast_to_tokens,
    episode_weights,
    group_stats,
)


@ADVANTAGES.register("rloo")
def rloo(inp: AdvantageInputs) -> AdvantageOutput:
    r = inp.rewards.float()
    counts, mean = group_stats(r, inp.group_index, episode_weights(inp))
    scale = counts / (counts - 1).clamp(min=1)
    scores = torch.where(counts > 1, (r - mean) * scale, r)
    adv = broadcast_to_tokens(scores, inp)
    return AdvantageOutput(adv, adv)
