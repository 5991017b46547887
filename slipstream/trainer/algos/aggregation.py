"""Loss aggregation: from a per-token loss to the scalar that is back-propagated.

Modes (verl's ``agg_loss``; ``m`` is the loss mask, ``s`` a sample, ``|s|`` its policy-token count):

    token-mean               sum_{s,t} m*l / N_tokens
    seq-mean-token-sum       sum_s (sum_t m*l)            / N_seqs
    seq-mean-token-mean      sum_s (sum_t m*l / |s|)      / N_seqs
    seq-mean-token-sum-norm  sum_s (sum_t m*l)            / (N_seqs * scale)   (Dr. GRPO; scale = a constant,
                                                                                 e.g. the max response length)

``N_tokens`` and ``N_seqs`` are counts over the whole *global* mini-batch (every rank, every micro-batch;
sequences with no policy token do not count), passed in by the caller. Each micro-batch therefore
returns its exact share of the global value, so summing micro-batches and ranks gives the same loss and
gradient however the batch is split — the property verl documents as "invariant to DP size". (The engine
multiplies by the data-parallel size before backward because FSDP averages gradients across ranks.)
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.segments import segment_ids, segment_sum

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    num_seqs: int,
    mode: str,
    *,
    global_tokens: float,
    global_seqs: float,
    scale: float = 1.0,
    count_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the global aggregate of ``values`` [T] under ``mask`` [T].

    ``count_mask`` (default ``mask``) gives each sequence's ``|s|`` for seq-mean-token-mean; pass the plain
    loss mask when ``mask`` also carries weights or rejections, so denominators stay fixed.
    """
    mask = mask.to(values.dtype)
    weighted = values * mask
    if mode == "token-mean":
        return weighted.sum() / max(float(global_tokens), 1.0)
    per_seq = segment_sum(weighted, seg, num_seqs)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out = per_seq.sum() / max(float(global_seqs), 1.0)
        return out / scale if mode == "seq-mean-token-sum-norm" else out
    if mode == "seq-mean-token-mean":
        counts = segment_sum((mask if count_mask is None else count_mask).to(values.dtype), seg, num_seqs)
        return (per_seq / counts.clamp(min=1)).sum() / max(float(global_seqs), 1.0)
    raise ValueError(
        f"trainer.algorithm.loss_agg_mode: unknown loss aggregation mode `{mode}`; known modes: {', '.join(AGG_MODES)}"
    )


def global_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[int, int]:
    """(policy tokens, sequences with at least one policy token) of a packed batch."""
    per_seq = segment_sum(loss_mask.float(), segment_ids(cu_seqlens), cu_seqlens.numel() - 1)
    return int(loss_mask.sum().item()), int((per_seq > 0).sum().item())
