"""Ulysses sequence parallelism: the ranks of a group split one packed micro-batch's tokens between them.

Why: activation memory grows with the tokens of a micro-batch, and one 32K-token response cannot be cut
into smaller micro-batches. With ``trainer.sequence_parallel_size = n`` each group of n consecutive ranks
trains on the same samples; every rank embeds and runs the decoder layers on 1/n of the packed row (the
micro-batch is padded to a multiple of n with a dummy sample). Everything per token (norms, MLPs, rotary
embeddings from each token's own position id) is local. Attention needs every token of a sample, so around
the attention kernel an all-to-all trades tokens for heads::

    q, k, v  [1, heads, T/n, d]   --all-to-all-->  [1, heads/n, T, d]    (all tokens, a slice of heads)
    kernel with the whole row's cu_seqlens (per-sample causal attention, as without parallelism)
    out      [1, T, heads/n, d]   --all-to-all-->  [1, T/n, heads, d]    (own tokens, all heads)

Both all-to-alls are differentiable (an all-to-all's gradient is the same all-to-all of the gradients).
After the final norm each rank scores its own tokens with the chunked output layer (``trainer/logprobs.py``;
the target of a rank's last token is the next rank's first) and :func:`gather_sequence` joins the per-token
results, so the loss sees the whole micro-batch on every rank of the group. Each rank computes that same
loss but back-propagates it only through its own slice, so the group's gradients sum to the gradient of
the whole micro-batch, and FSDP's average over all ranks (the engine scales the loss by the world size)
stays the mean over data-parallel replicas.

Coverage: any transformers decoder that calls its attention through ``AttentionInterface`` with
[batch, heads, tokens, dim] tensors and rotary embeddings from ``position_ids`` (Llama, Qwen2, Qwen3,
Mistral; tested on Llama), packed micro-batches only, with a varlen kernel inside (``sdpa_varlen`` or
flash-attention). Query heads must divide by n; KV heads must divide by n or divide n (then each is
repeated, GQA-style, so every rank holds the KV head its query heads read). Sliding-window layers are not
handled.

Use: :func:`register` returns the attention name to load the model with (``ulysses_<kernel>``); pass
``ulysses_group=group`` in the model call (it travels with the other attention keywords, also into
activation-checkpoint recomputation). Without that keyword the wrapped kernel runs alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PREFIX = "ulysses_"
VARLEN_KERNELS = ("sdpa_varlen", "flash_attention_2", "flash_attention_3")


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 goes to rank i of ``group``; chunk j of the result came from rank j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSequence(torch.autograd.Function):
    """Concatenate every rank's equal-length slice; backward keeps this rank's slice of the gradient (every
    rank computes the same loss from the gathered whole, so each owns the gradient of its own part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.slice = (rank * x.shape[0], (rank + 1) * x.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        a, b = ctx.slice
        return grad[a:b], None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
    """[T/n, ...] per rank -> [T, ...] in rank order (differentiable, see :class:`_GatherSequence`)."""
    return _GatherSequence.apply(x, group)


def heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
    """[1, H, T/n, d] (own tokens, all heads) -> [1, H/n, T, d] (all tokens, this rank's heads)."""
    n = dist.get_world_size(group)
    _, h, t, d = x.shape
    y = _AllToAll.apply(x.reshape(n, h // n, t, d), group)  # y[j]: rank j's tokens, my heads
    return y.transpose(0, 1).reshape(1, h // n, n * t, d)


def tokens_to_heads(x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
    """[1, T, H/n, d] (all tokens, this rank's heads) -> [1, T/n, H, d] (own tokens, all heads)."""
    n = dist.get_world_size(group)
    _, t, h, d = x.shape
    y = _AllToAll.apply(x.reshape(n, t // n, h, d), group)  # y[i]: my tokens, rank i's heads
    return y.transpose(0, 1).reshape(1, t // n, n * h, d)


def _spread_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat KV heads so that n ranks each hold the ones their query heads read (when n > KV heads)."""
    kv = x.shape[1]
    if kv % n == 0:
        return x
    if n % kv:
        raise ValueError(f"sequence_parallel_size {n} and {kv} KV heads: one must divide the other")
    return x.repeat_interleave(n // kv, dim=1)


def _make_attention(inner: str):  # noqa: ANN202
    from transformers import AttentionInterface

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):  # noqa: ANN001, ANN202
        group = kwargs.pop("ulysses_group", None)
        kernel = AttentionInterface._global_mapping[inner]
        if group is None:
            return kernel(module, query, key, value, attention_mask, *args, **kwargs)
        n = dist.get_world_size(group)
        if query.shape[1] % n:
            raise ValueError(f"{query.shape[1]} attention heads do not split over {n} ranks")
        q = heads_to_tokens(query, group)
        k = heads_to_tokens(_spread_kv(key, n), group)
        v = heads_to_tokens(_spread_kv(value, n), group)
        # the kernel sees the whole row: per-sample causal attention from the full cu_seq_lens
        out, weights = kernel(module, q, k, v, None, *args, **kwargs)
        return tokens_to_heads(out, group), weights

    return ulysses_attention


def register(inner: str) -> str:
    """Register ``ulysses_<inner>`` with transformers (attention and mask); return that name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if inner not in VARLEN_KERNELS:
        raise ValueError(
            f"trainer.attn_implementation: unknown varlen attention kernel `{inner}` (sequence parallelism "
            f"needs one); known kernels: {', '.join(VARLEN_KERNELS)}"
        )
    if inner == "sdpa_varlen":
        from slipstream.trainer.engine import varlen  # noqa: F401  (registers the kernel)
    name = PREFIX + inner
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _make_attention(inner))
        # no mask: the kernel attends within samples from cu_seq_lens, and a rank's local mask would be wrong
        AttentionMaskInterface.register(name, _no_mask)
    return name


def _no_mask(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    return None


def inner_kernel(name: str) -> str:
    """The kernel a (possibly ``ulysses_``-wrapped) attention name runs."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def build_groups(world: int, size: int) -> tuple[object, object]:
    """(this rank's sequence-parallel group, its data-parallel group). Collective: every rank creates every
    group in the same order. SP groups are blocks of ``size`` consecutive ranks; a DP group holds the ranks
    at one position of every block, in block order, so its group rank equals the replica index."""
    if world % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide {world} ranks")
    rank = dist.get_rank()
    sp_group = dp_group = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            sp_group = g
    for pos in range(size):
        g = dist.new_group(list(range(pos, world, size)))
        if rank % size == pos:
            dp_group = g
    return sp_group, dp_group
