"""REINFORCE++ with a group-mean baseline.

Hu, "REINFORCE++" (arXiv 2501.03262), the variant for reasoning tasks with several samples per prompt:

    A_i = r_i - mean(r over the group of i)       (a group of one sample: baseline 0)

broadcast to every policy token, then whitened across every policy token of the batch (global mean,
Bessel-corrected variance, as verl's ``masked_whiten``).
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
from slipstream.trainer.algos.segments import masked_whiten


@ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inp: AdvantageInputs) -> AdvantageOutput:
    r = inp.rewards.float()
    counts, mean = group_stats(r, inp.group_index, episode_weights(inp))
    scores = r - torch.where(counts > 1, mean, torch.zeros_like(mean))
    tokens = broadcast_to_tokens(scores, inp)
    adv = masked_whiten(tokens, inp.loss_mask) * inp.loss_mask.float()
    return AdvantageOutput(adv, adv)
