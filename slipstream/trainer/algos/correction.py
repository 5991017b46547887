"""Off-policy correction between the behaviour policy (the inference server that sampled the tokens) and
the proximal policy (the trainer's weights at the start of the step, recomputed by a forward pass).

With ``log_ratio = logp_prox - logp_behav`` per token:

**Truncated importance sampling** (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training", 2025; verl ``rollout_is`` with a single threshold), weights multiplied into the policy loss and
never differentiated:

    token:     w_t = min(exp(log_ratio_t), cap)
    sequence:  w_s = min(exp(sum_{t in s} log_ratio_t), cap)     (the same weight on every token of s)

**Rejection masks** (verl ``rollout_rs``; Liu et al., "When Speed Kills Stability", 2025): zero the loss of
tokens or whole sequences whose divergence leaves a trust region. Per-token statistics, as verl:

    k1 = -log_ratio   (kept when log(low) <= k1 <= log(high): a bound on the ratio pi_behav / pi_prox)
    k2 = 0.5 * log_ratio**2,   k3 = exp(log_ratio) - 1 - log_ratio   (kept when <= high)

aggregated per sequence as ``seq_sum_*`` (sum over the sequence's policy tokens), ``seq_mean_*`` (mean; with
k1 this is the geometric-mean ratio) or ``seq_max_*`` (max, k2/k3 only); ``token_*`` decides per token.
Log-ratios are clamped to [-20, 20] before exponentiating.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from slipstream.trainer.algos.segments import segment_max, segment_sum
from slipstream.utils.registry import Registry

SAFETY_BOUND = 20.0

REJECTIONS: Registry = Registry(
    "rejection criterion", "trainer.algorithm.rejection", plural="rejection criteria"
)


def truncated_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    num_seqs: int,
    level: str,
    cap: float,
) -> torch.Tensor:
    """Detached IS weights [T] (0 outside ``mask``) at ``level`` "token" or "sequence"."""
    mask_f = mask.to(log_ratio.dtype)
    log_ratio = log_ratio.detach()
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        per_seq = segment_sum(log_ratio * mask_f, seg, num_seqs)
        raw = torch.exp(torch.clamp(per_seq, -SAFETY_BOUND, SAFETY_BOUND))[seg]
    else:
        raise ValueError(
            f"unknown truncated-IS level {level!r} (trainer.algorithm.tis_level): token, sequence"
        )
    return raw.clamp(max=cap) * mask_f


def _token_stats(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    lr = torch.clamp(log_ratio.detach(), -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}


def _bounds(kind: str, low: float | None, high: float) -> tuple[float, float]:
    if kind == "k1":
        low = 1.0 / high if low is None else low
        if not 0 < low <= high:
            raise ValueError(f"rejection bounds must satisfy 0 < low <= high, got low={low}, high={high}")
        return math.log(low), math.log(high)
    return float("-inf"), high


def _make(level: str, kind: str) -> Callable[..., torch.Tensor]:
    def criterion(
        log_ratio: torch.Tensor,
        mask: torch.Tensor,
        seg: torch.Tensor,
        num_seqs: int,
        low: float | None,
        high: float,
    ) -> torch.Tensor:
        stat = _token_stats(log_ratio)[kind]
        lo, hi = _bounds(kind, low, high)
        mask_f = mask.to(stat.dtype)
        if level == "token":
            keep = (stat >= lo) & (stat <= hi)
            return keep.to(stat.dtype)
        if level == "seq_sum":
            per_seq = segment_sum(stat * mask_f, seg, num_seqs)
        elif level == "seq_mean":
            per_seq = segment_sum(stat * mask_f, seg, num_seqs) / segment_sum(mask_f, seg, num_seqs).clamp(
                min=1
            )
        else:
            per_seq = segment_max(stat, seg, num_seqs, mask_f)
        keep = (per_seq >= lo) & (per_seq <= hi)
        return keep.to(stat.dtype)[seg]

    criterion.__name__ = f"{level}_{kind}"
    criterion.__doc__ = (
        f"Keep-mask [T] (1 keep, 0 reject) of the `{level}_{kind}` criterion (module docstring)."
    )
    return criterion


for _level, _kinds in (
    ("token", ("k1", "k2", "k3")),
    ("seq_sum", ("k1", "k2", "k3")),
    ("seq_mean", ("k1", "k2", "k3")),
    ("seq_max", ("k2", "k3")),
):
    for _kind in _kinds:
        REJECTIONS.register(f"{_level}_{_kind}")(_make(_level, _kind))
