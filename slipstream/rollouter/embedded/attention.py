"""Per-request attention for continuous batching with SDPA (the CPU path).

transformers' continuous batching packs every request of a step into one sequence. With flash attention
(GPU) the kernel takes the request boundaries (``cu_seq_lens_q/k``) and attends within each request. With
SDPA it instead builds one ``[all queries, all keys]`` mask and lets SDPA compute attention between every
pair of requests, then masks most of it away: a 32-request prefill of 45-token prompts is a 1474 x 1474
attention per head and layer, and a decode step of 32 requests attends over the keys of all 32. On a
2-core CPU that made a step ~1.4x (decode) to ~5x (prefill) slower than ``generate``'s padded batch.

:func:`install` re-registers the ``"sdpa"`` attention function with one that, for calls carrying the
boundaries of a paged continuous-batching step, attends within each request only (causal within the
request, offset by its cached prefix). Every other call (training, ``generate``, models without a paged
cache) goes to transformers' own SDPA function unchanged, so installing it in a process that also trains
is harmless. Results equal the masked version up to float rounding.

Two ways to run a step, chosen from the device, the shapes and the host-side lengths transformers passes
(``max_length_q/k``), so choosing never reads the device:

* **batched** (on an accelerator: every decode step, and prefills of similar lengths): each request's
  queries and keys are gathered into a ``[requests, heads, max_q, max_k]`` block and one masked SDPA call
  covers them all; the indexes are built on the device from ``cu_seq_lens_q/k``, so nothing is read back
  to the host and the step never waits for the device (the per-request loop synchronised twice per layer);
* **per request** (on CPU, and ragged steps elsewhere, e.g. one long prefill chunk beside many decodes,
  where padding would multiply the work): one unmasked SDPA call per request on its own slice, with the
  boundaries read on the host. On CPU that read costs nothing, and the loop takes about half the CPU time
  of one masked call (CPU SDPA has no fast masked kernel: 1.0 against 2.0 ms per layer for 32 decoding
  requests of SmolLM2-135M's shapes, thread CPU time), so CPU keeps it.

Which transformers versions call it: the ``"sdpa"`` function receives the paged cache (``cache=``) and
updates it itself in 5.19 to 5.23; from 5.24 the attention module updates the cache and passes only the
full keys, which this function accepts too. 5.16 to 5.18 route continuous batching to their own
``"paged|sdpa"`` function instead, so the engine falls back to transformers' cross-request attention
there (:func:`is_routed` tells, and the engine logs it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

_installed = False
# Batched attention is chosen when padding every request to the longest one at most doubles the query
# rows and key rows it reads, and the padded score block stays under this many elements (64 Mi: 256 MB in fp32).
_MAX_PADDING_FACTOR = 2
_MAX_BATCHED_SCORES = 1 << 26
# Devices that run the per-request loop even when batched attention fits (tests clear it to compare both).
LOOP_DEVICES = frozenset({"cpu"})


def install() -> None:
    """Route paged continuous-batching SDPA calls through :func:`paged_varlen_sdpa` (idempotent)."""
    global _installed
    if not _installed:
        AttentionInterface.register("sdpa", paged_varlen_sdpa)
        _installed = True


def is_routed(attn_implementation: str) -> bool:
    """True when continuous batching with ``attn_implementation`` reaches :func:`paged_varlen_sdpa`."""
    if f"paged|{attn_implementation}" in ALL_ATTENTION_FUNCTIONS:  # 5.16-5.18: continuous batching calls that
        return False
    return ALL_ATTENTION_FUNCTIONS.get(attn_implementation) is paged_varlen_sdpa


def paged_varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, total_q, dim]
    key: torch.Tensor,  # [1, kv_heads, new_k, dim] (with cache=) or [1, kv_heads, total_k, dim] (without)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    paged = isinstance(cache, PagedAttentionCache) or (cache is None and "read_index" in kwargs)
    per_request = (
        paged
        and query.shape[0] == 1
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
    if cache is not None:  # transformers 5.19-5.23: the attention function updates the cache
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs
        )
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    gqa = query.shape[1] != key.shape[1]
    if isinstance(max_q, int) and isinstance(max_k, int) and _batched_fits(query, key, cu_q, max_q, max_k):
        attn = batched_varlen_sdpa(query, key, value, cu_q, cu_k, max_q, max_k, scaling, gqa)
    else:
        attn = looped_varlen_sdpa(query, key, value, cu_q, cu_k, scaling, gqa)
    return attn.transpose(1, 2).contiguous(), None


def _batched_fits(query: torch.Tensor, key: torch.Tensor, cu_q: torch.Tensor, max_q: int, max_k: int) -> bool:
    """Whether padding every request to ``max_q`` queries and ``max_k`` keys stays cheap (shapes only)."""
    n = cu_q.shape[0] - 1
    if query.device.type in LOOP_DEVICES or n < 1 or max_q < 1 or max_k < 1:
        return False
    return (
        n * max_q <= _MAX_PADDING_FACTOR * query.shape[2]
        and n * max_k <= _MAX_PADDING_FACTOR * key.shape[2]
        and n * query.shape[1] * max_q * max_k <= _MAX_BATCHED_SCORES
    )


def batched_varlen_sdpa(
    query: torch.Tensor,  # [1, heads, total_q, dim]
    key: torch.Tensor,  # [1, kv_heads, total_k, dim]
    value: torch.Tensor,
    cu_q: torch.Tensor,  # [n + 1]
    cu_k: torch.Tensor,  # [n + 1]
    max_q: int,
    max_k: int,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention within each request as one masked SDPA call; returns ``[1, heads, total_q, dim]``.

    Request i owns queries ``cu_q[i]:cu_q[i+1]`` and keys ``cu_k[i]:cu_k[i+1]``; its last query sees all
    its keys, and query j sees keys up to ``(n_k - n_q) + j`` (its cached prefix plus the chunk so far).
    Query rows past ``cu_q[-1]`` (padding for static shapes) come back as zeros. No host synchronisation.
    """
    device = query.device
    starts_q, starts_k = cu_q[:-1].long(), cu_k[:-1].long()
    lens_q, lens_k = cu_q[1:].long() - starts_q, cu_k[1:].long() - starts_k
    j = torch.arange(max_q, device=device)
    t = torch.arange(max_k, device=device)
    q_rows = (starts_q[:, None] + j).clamp(max=query.shape[2] - 1)  # [n, max_q]
    k_rows = (starts_k[:, None] + t).clamp(max=key.shape[2] - 1)  # [n, max_k]
    # Key t is visible to query j when it belongs to the request and is not in the query's future. Column 0
    # stays open so that the rows of empty (padding) requests are finite; their outputs are never read.
    visible = (t < lens_k[:, None])[:, None, :] & (
        t[None, None, :] <= (lens_k - lens_q)[:, None, None] + j[None, :, None]
    )
    visible[:, :, 0] = True
    q = _gather_rows(query, q_rows)  # [n, heads, max_q, dim]
    k = _gather_rows(key, k_rows)  # [n, kv_heads, max_k, dim]
    v = _gather_rows(value, k_rows)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scaling, enable_gqa=gqa)
    # Packed query row r belongs to request seg[r], at position r - cu_q[seg[r]] of its chunk.
    rows = torch.arange(query.shape[2], device=device)
    seg = torch.searchsorted(cu_q[1:].long(), rows, right=True).clamp(max=starts_q.shape[0] - 1)
    flat = seg * max_q + (rows - starts_q[seg]).clamp(0, max_q - 1)
    picked = out.transpose(1, 2).reshape(-1, query.shape[1], query.shape[3]).index_select(0, flat)
    picked = picked.masked_fill((rows >= cu_q[-1])[:, None, None], 0.0)  # [total_q, heads, dim]
    return picked.transpose(0, 1).unsqueeze(0)


def _gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[0][:, rows]`` for ``x`` [1, heads, L, dim] and ``rows`` [n, m], as [n, heads, m, dim].

    Queries and cached keys are laid out token-major ([L, heads, dim] underneath the transposed view), so
    whole tokens are gathered along the first dimension: several times faster on CPU than advanced
    indexing with a 2-D index or a gather along the strided token dimension.
    """
    n, m = rows.shape
    picked = x[0].transpose(0, 1).index_select(0, rows.reshape(-1))  # [n * m, heads, dim]
    return picked.view(n, m, x.shape[1], x.shape[3]).transpose(1, 2)


def looped_varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention within each request, one SDPA call per request (reads the boundaries on the host)."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
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
    return attn
