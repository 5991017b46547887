"""GRPO: group-relative advantages.

Shao et al., "DeepSeekMath" (arXiv 2402.03300), §4.1.2, outcome supervision: for the n samples of one
prompt with rewards r_1..r_n,

    A_i = (r_i - mean(r)) / (std(r) + eps)        (norm_by_std=True, std with Bessel's correction)
    A_i =  r_i - mean(r)                          (norm_by_std=False: Dr. GRPO, Liu et al. arXiv 2503.20783)

broadcast to every policy token of sample i. The n are episodes: the segments of one agent episode
(trained as sequences of their own) count once (``episode_weights``). As in verl: a group of one sample gets mean 0 and std 1 (its
advantage is its reward), and a group whose rewards are all equal gets advantage 0 (std 0, so 0 / eps).
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


@ADVANTAGES.register("grpo")
def grpo(inp: AdvantageInputs) -> AdvantageOutput:
    r = inp.rewards.float()
    w = episode_weights(inp)
    counts, mean = group_stats(r, inp.group_index, w)
    dev = r - mean
    _, inv = torch.unique(inp.group_index, return_inverse=True)
    sq = torch.zeros_like(r).index_add(0, inv, w * dev * dev)[inv]
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    scores = (r - mean) / (std + inp.eps) if inp.norm_by_std else r - mean
    adv = broadcast_to_tokens(scores, inp)
    return AdvantageOutput(adv, adv)
