"""Advantage estimators: ``ADVANTAGES.get(cfg.trainer.algorithm.adv_estimator)(AdvantageInputs) -> AdvantageOutput``.

Each estimator is a pure tensor function in its own module, registered under the name users write in
``trainer.algorithm.adv_estimator``. Formulas follow verl's ``core_algos.py`` (the reference every peer
compares against); where ours deliberately differ the estimator's docstring says so.

Inputs are packed: token tensors are flat ``[T]`` over the whole step batch (every rank computes advantages
on the full batch, so batch-level statistics such as REINFORCE++'s whitening do not depend on the number of
ranks). Outcome rewards are per sample ``[N]``; ``group_index`` says which samples share a prompt.

To add an estimator: write ``advantages/<name>.py`` with a function decorated by
``@ADVANTAGES.register("<name>")`` taking :class:`AdvantageInputs` and returning :class:`AdvantageOutput`,
and import the module at the bottom of this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.trainer.algos.segments import segment_ids
from slipstream.utils.registry import Registry


@dataclass
class AdvantageInputs:
    """What an estimator may read. Token tensors are flat [T]; per-sample tensors are [N]."""

    rewards: torch.Tensor  # float [N]: the outcome reward of each sample
    group_index: torch.Tensor  # int64 [N]: samples with the same value answer the same prompt
    loss_mask: torch.Tensor  # bool [T]: tokens the policy generated (the ones that get an advantage)
    cu_seqlens: torch.Tensor  # int [N+1]: sample boundaries on the token axis
    values: torch.Tensor | None = None  # float [T]: critic values V(s_t) aligned like logprobs (gae only)
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6
    # int64 [N]: samples with the same value are segments of one agent episode (same reward), counted once in
    # their group's statistics; None: every sample is an episode of its own.
    episode_index: torch.Tensor | None = None


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # float [T], zero outside loss_mask
    returns: torch.Tensor  # float [T]: value targets (gae) or the advantages themselves (outcome methods)


ADVANTAGES: Registry = Registry("advantage estimator", "trainer.algorithm.adv_estimator")


def broadcast_to_tokens(per_sample: torch.Tensor, inp: AdvantageInputs) -> torch.Tensor:
    """Spread one scalar per sample over that sample's tokens, zero outside ``loss_mask``."""
    return per_sample[segment_ids(inp.cu_seqlens)] * inp.loss_mask.to(per_sample.dtype)


def episode_weights(inp: AdvantageInputs) -> torch.Tensor:
    """float [N]: 1 / (segments in the sample's episode), so each episode weighs 1 in its group's statistics
    whatever the number of sequences it was trained as; all ones without ``episode_index``."""
    r = inp.rewards
    if inp.episode_index is None:
        return torch.ones_like(r, dtype=torch.float32)
    _, inv, counts = torch.unique(inp.episode_index, return_inverse=True, return_counts=True)
    return 1.0 / counts[inv].to(torch.float32)


def group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (count of its group, mean of its group), vectorised over groups; with ``weights``
    (:func:`episode_weights`) the count is of episodes and the mean is over episodes."""
    w = torch.ones_like(rewards) if weights is None else weights.to(rewards.dtype)
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    # Whole episodes per group, whatever the float rounding of 1/3 + 1/3 + 1/3 (a group holds every segment).
    counts = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add(0, inv, w).round()
    sums = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add(0, inv, w * rewards)
    return counts[inv], (sums / counts)[inv]


def last_token_rewards(inp: AdvantageInputs) -> torch.Tensor:
    """Token-level rewards [T]: each sample's outcome reward on its last policy token, 0 elsewhere."""
    t = inp.loss_mask.numel()
    idx = torch.arange(t, device=inp.loss_mask.device)
    marked = torch.where(inp.loss_mask, idx, torch.full_like(idx, -1))
    seg = segment_ids(inp.cu_seqlens)
    last = torch.full((inp.rewards.numel(),), -1, dtype=idx.dtype, device=idx.device)
    last = last.scatter_reduce(0, seg, marked, reduce="amax", include_self=True)
    out = torch.zeros(t, dtype=inp.rewards.dtype, device=idx.device)
    has = last >= 0
    out[last[has]] = inp.rewards[has]
    return out


# Registration happens on import; keep this list in sync with the modules of this package.
from slipstream.trainer.algos.advantages import (  # noqa: E402,F401
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)

__all__ = ["ADVANTAGES", "AdvantageInputs", "AdvantageOutput", "broadcast_to_tokens", "group_stats"]
