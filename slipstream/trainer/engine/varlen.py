"""``sdpa_varlen``: an attention kernel for packed micro-batches on CPU (and any device without flash-attn).

transformers' own answer to packed position ids under sdpa is a dense block-diagonal causal mask over the
whole row, which costs O(T^2) for T packed tokens and sends CPU sdpa down its masked path. This kernel
instead runs causal sdpa on each sample's slice (boundaries from ``cu_seq_lens_q``, the keyword
transformers forwards from the model call to every attention layer), so attention costs sum(len_i^2) and
never looks at a mask. Calls without boundaries (the padded baseline, generation) fall through to
transformers' regular sdpa with its regular mask, so one loaded model serves both layouts.

The sample boundaries are read to the host once per forward, not once per layer: every layer receives the
same ``cu_seq_lens_q`` tensor, so the lengths read by the first layer are kept (keyed by that tensor and
its version counter) for the others. On a GPU each read waits for the device; per layer that was one wait
per layer and micro-batch, in the forward and again in a recomputed (checkpointed) forward.

Registered under the name ``sdpa_varlen`` in transformers' ``AttentionInterface`` (and its mask builder
under the same name) on import; pass ``attn_implementation="sdpa_varlen"`` when loading a model.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_varlen"

# The last boundaries read: (the cu_seq_lens tensor, its version counter, per-sample lengths).
_last_read: tuple[weakref.ref, int, list[int]] | None = None


def sample_lengths(cu: torch.Tensor) -> list[int]:
    """Per-sample lengths from ``cu_seq_lens``; read to the host once per tensor (i.e. once per forward)."""
    global _last_read
    last = _last_read
    if last is not None and last[0]() is cu and last[1] == cu._version:
        return last[2]
    bounds = read_bounds(cu)
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    _last_read = (weakref.ref(cu), cu._version, lengths)
    return lengths


def read_bounds(cu: torch.Tensor) -> list[int]:
    """The host read (a device synchronisation on a GPU); a function of its own so tests can count it."""
    return cu.tolist()


def sdpa_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query/key/value: [1, heads, T, dim] (kv heads may be fewer: GQA). Returns ([1, T, heads, dim], None).

    With ``prefix_blocks`` (a shared-prompt row, ``engine/prefix.py``) the row is attended block by block.
    """
    blocks = kwargs.get("prefix_blocks")
    if blocks is not None:
        from slipstream.trainer.engine.prefix import prefix_attention

        drop = dropout if module.training else 0.0
        return prefix_attention(query, key, value, blocks, drop, scaling).transpose(1, 2).contiguous(), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    lengths = sample_lengths(cu)
    gqa = query.shape[1] != key.shape[1]
    # split/cat rather than slicing into a preallocated output: their backward is one concatenation, where
    # per-slice backward would allocate a full-size zero gradient for every sample
    pieces = [
        F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=dropout if module.training else 0.0,
            scale=scaling,
            enable_gqa=gqa,
        )
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
        if q.shape[2] > 0
    ]
    out = torch.cat(pieces, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_varlen_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
