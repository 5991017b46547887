"""Per-sample reductions on packed (unpadded) token tensors.

The trainer never pads: a batch is one flat token axis with samples laid end to end and ``cu_seqlens``
(cumulative lengths, ``[0, l0, l0+l1, ...]``) marking where each sample starts. Algorithms that need a
per-sample quantity (a sequence ratio, a per-sequence token mean) reduce over that axis with the helpers
here, so every algorithm stays a pure function of flat tensors and no padding token is ever computed.
"""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The sample index of every token: ``[0, 0, 1, 1, 1, 2]`` for ``cu_seqlens = [0, 2, 5, 6]``.

    The one place the packed layout is turned into per-token sample indices: index a per-sample tensor
    with it to spread one value per sample over its tokens (``per_sample[segment_ids(cu)]``).
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def token_positions(cu_seqlens: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """Every token's position within its own sample: ``[0, 1, 0, 1, 2, 0]`` for ``[0, 2, 5, 6]``."""
    seg = segment_ids(cu_seqlens) if seg is None else seg
    return torch.arange(seg.numel(), device=cu_seqlens.device) - cu_seqlens.long()[seg]


def segment_sum(values: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of ``values`` [T] per segment → [num_segments] (differentiable)."""
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, seg, values)


def segment_max(
    values: torch.Tensor, seg: torch.Tensor, num_segments: int, mask: torch.Tensor
) -> torch.Tensor:
    """Max of ``values`` over the masked tokens of each segment; 0 for a segment with no masked token."""
    fill = torch.full((num_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    masked = torch.where(mask > 0, values, torch.full_like(values, float("-inf")))
    out = fill.scatter_reduce(0, seg, masked, reduce="amax", include_self=True)
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries, with Bessel-corrected variance (as verl).

    With fewer than two masked entries the variance is taken as 0 rather than dividing by zero.
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    var = (((values - mean) ** 2) * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps)


def to_padded(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Flat [T] → [N, max_len] (right-padded with ``fill``), for the few recurrences that run per step."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n, width = lengths.numel(), int(lengths.max().item()) if lengths.numel() else 0
    out = torch.full((n, width), fill, dtype=values.dtype, device=values.device)
    seg = segment_ids(cu_seqlens)
    out[seg, token_positions(cu_seqlens, seg)] = values
    return out


def from_padded(padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_padded`."""
    seg = segment_ids(cu_seqlens)
    return padded[seg, token_positions(cu_seqlens, seg)]
