"""Per-request attention for continuous batching with SDPA (the CPU path).

transformers' continuous batching packs every request of a step into one sequence. With flash attention
(GPU) the kernel takes the request boundaries (``cu_seq_lens_q/k``) and attends within each request. With
SDPA it instead builds one ``[all queries, all keys]`` mask and lets SDPA compute attention between every
pair of requests, then masks most of it away: a 32-request prefill of 45-token prompts is a 1474 x 1474
attention per head and layer, and a decode step of 32 requests attends over the keys of all 32. On a
2-core CPU that made a step ~1.4x (decode) to ~5x (prefill) slower than ``generate``'s padded batch.

:func:`install` re-registers the ``"sdpa"`` attention function with one that, for calls carrying a paged
continuous-batching cache, runs SDPA once per request on that request's own queries and keys (causal
within the request, offset by its cached prefix). Every other call (training, ``generate``, models without
a paged cache) goes to transformers' own SDPA function unchanged, so installing it in a process that also
trains is harmless. Results equal the masked version up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

_installed = False


def install() -> None:
    """Route paged continuous-batching SDPA calls through :func:`paged_varlen_sdpa` (idempotent)."""
    global _installed
    if not _installed:
        AttentionInterface.register("sdpa", paged_varlen_sdpa)
        _installed = True


def paged_varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, total_q, dim]
    key: torch.Tensor,  # [1, kv_heads, new_k, dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    per_request = (
        isinstance(cache, PagedAttentionCache)
        and kwargs.get("block_table") is None
        and getattr(module, "sliding_window", None) is None
        and "cu_seq_lens_q" in kwargs
        and not kwargs.get("output_attentions", False)
    )
    if not per_request:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            cache=cache, **kwargs,
        )  # fmt: skip
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    cu_q = kwargs["cu_seq_lens_q"].tolist()
    cu_k = kwargs["cu_seq_lens_k"].tolist()
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
        n_q, n_k = q1 - q0, k1 - k0
        mask = None
        if 1 < n_q < n_k:  # a chunk after a cached prefix: query j sees keys up to (n_k - n_q) + j
            offset = n_k - n_q
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=(n_q > 1 and n_q == n_k), scale=scaling, enable_gqa=gqa
        )
        outputs.append(out)
    attn = torch.cat(outputs, dim=2)
    if attn.shape[2] < query.shape[2]:  # padded queries (static shapes): their outputs are never read
        pad = query.new_zeros(1, query.shape[1], query.shape[2] - attn.shape[2], query.shape[3])
        attn = torch.cat([attn, pad], dim=2)
    return attn.transpose(1, 2).contiguous(), None
