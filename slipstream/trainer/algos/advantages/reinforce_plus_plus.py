"""REINFORCE++: discounted token returns, whitened over the whole batch.

Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models" (arXiv 2501.03262):
the outcome reward sits on each sample's last policy token, token returns are

    G_t = r_t + gamma * G_{t+1}      (over the sample's policy tokens)

and the advantage is G whitened across every policy token of the batch (global mean and Bessel-corrected
variance, as verl's ``masked_whiten``). Returns are G itself.

Difference from verl, on purpose: verl resets the running return at every token outside the loss mask, so
in a multi-turn sample the policy tokens before a tool response would get no credit for the final reward;
we carry the return across non-policy tokens instead (as verl's own GAE does for observation tokens).
For single-turn samples the two are identical.
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


def discounted_returns(inp: AdvantageInputs, token_rewards: torch.Tensor) -> torch.Tensor:
    """G_t over each sample's policy tokens (0 on other tokens)."""
    rew = to_padded(token_rewards.float(), inp.cu_seqlens)
    mask = to_padded(inp.loss_mask.float(), inp.cu_seqlens)
    returns = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[0], dtype=rew.dtype, device=rew.device)
    for t in reversed(range(rew.shape[1])):
        running = torch.where(mask[:, t] > 0, rew[:, t] + inp.gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return from_padded(returns, inp.cu_seqlens)


@ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus(inp: AdvantageInputs) -> AdvantageOutput:
    returns = discounted_returns(inp, last_token_rewards(inp))
    adv = masked_whiten(returns, inp.loss_mask) * inp.loss_mask.float()
    return AdvantageOutput(adv, returns)
