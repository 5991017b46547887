"""Shared-prompt micro-batches: each group's prompt runs through the model once, not once per sample.

GRPO-style batches hold ``rollout.n`` samples per prompt (8 in the quickstart, 16 in DAPO recipes), packed
end to end, so a packed micro-batch repeats every prompt n times: in the quickstart 46 of a sample's ~61
tokens are its group's prompt, and three quarters of the trainer's FLOPs recompute the same prompt
activations. With ``trainer.share_prompt_prefix`` the engine instead lays a micro-batch out as one
*compressed row*: per group, the tokens its samples have in common (their longest common prefix of token
ids, found from the ids themselves, so agent episodes with the same system prompt and question share too),
then each sample's own remainder (its *suffix*)::

    packed:      [P a1 a2] [P b1] [P c1 c2 c3]          (P = the group's shared prefix, 3 copies)
    compressed:  [P] [a1 a2] [b1] [c1 c2 c3]           (1 copy; suffix positions continue after P)

Attention (the ``sdpa_varlen`` kernel, ``engine/varlen.py``) then runs per group: the prefix causally, and
the suffixes with a mask that lets each suffix token see the whole prefix and the earlier tokens of its own
suffix, never another sample's. Every token sees exactly the tokens it saw in the packed row at the same
positions, so logits are the same; gradients are too, since the prefix's activations now collect the sum of
the gradients that its copies received one by one. :class:`PrefixLayout.index` maps every packed token to
its row, so the output layer scores packed token j + 1 from row ``index[j]`` and results come back in the
packed layout that losses read.

Groups whose samples share nothing (or a group of one sample) are rows of their own, causal as before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from slipstream.trainer.algos.segments import segment_ids


@dataclass(frozen=True)
class PrefixBlock:
    """One group's rows: ``prefix`` shared tokens then its samples' suffixes of ``suffix_lens`` tokens."""

    prefix: int
    suffix_lens: tuple[int, ...]
    # [sum(suffix_lens), prefix + sum(suffix_lens)] True where a suffix row may attend (None: no suffix)
    mask: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.prefix + sum(self.suffix_lens)


@dataclass(frozen=True)
class PrefixLayout:
    """A micro-batch's compressed row: ``ids``/``positions`` [R], the ``blocks`` in row order, and for each
    of the packed row's t tokens the compressed row that holds it (``index`` [t])."""

    ids: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor
    blocks: tuple[PrefixBlock, ...]

    @property
    def saved_tokens(self) -> int:
        return self.index.numel() - self.ids.numel()


def build_layout(mb: TensorDict) -> PrefixLayout | None:
    """The compressed layout of packed micro-batch ``mb`` (needs ``group_index``), or None when no two of
    its samples share a prefix (nothing to save: the caller runs the packed row as it is)."""
    if "group_index" not in mb.keys():
        return None
    ids, pos = mb["input_ids"], mb["position_ids"]
    bounds = mb["cu_seqlens"].tolist()
    members: dict[int, list[int]] = {}
    for sample, group in enumerate(mb["group_index"].tolist()):
        members.setdefault(group, []).append(sample)
    spans = [[(bounds[s], bounds[s + 1]) for s in samples] for samples in members.values()]
    prefixes = [_shared_prefix(ids, group) for group in spans]
    if not any(prefixes):
        return None
    index = torch.empty(ids.numel(), dtype=torch.long, device=ids.device)
    blocks: list[PrefixBlock] = []
    row = 0
    for group, prefix in zip(spans, prefixes, strict=True):
        if prefix == 0:  # nothing shared: every sample is a block of its own
            for start, end in group:
                index[start:end] = torch.arange(row, row + end - start, device=ids.device)
                blocks.append(PrefixBlock(end - start, (), None))
                row += end - start
            continue
        shared = torch.arange(row, row + prefix, device=ids.device)
        row += prefix
        for start, end in group:
            index[start : start + prefix] = shared
            index[start + prefix : end] = torch.arange(row, row + end - start - prefix, device=ids.device)
            row += end - start - prefix
        suffixes = tuple(end - start - prefix for start, end in group)
        blocks.append(PrefixBlock(prefix, suffixes, _suffix_mask(prefix, suffixes, ids.device)))
    row_ids = ids.new_empty(row).index_copy_(0, index, ids)  # shared rows receive identical values
    row_pos = pos.new_empty(row).index_copy_(0, index, pos)
    return PrefixLayout(row_ids, row_pos, index, tuple(blocks))


def _shared_prefix(ids: torch.Tensor, spans: list[tuple[int, int]]) -> int:
    """Length of the longest common prefix of the samples at ``spans``; 0 for one sample. At most the
    shortest sample's length less one, so that every sample keeps a suffix of its own."""
    if len(spans) < 2:
        return 0
    n = min(end - start for start, end in spans) - 1
    first = ids[spans[0][0] : spans[0][0] + n]
    same = torch.ones(n, dtype=torch.bool, device=ids.device)
    for start, _ in spans[1:]:
        same &= ids[start : start + n] == first
    differ = (~same).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def _suffix_mask(prefix: int, suffixes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[S, prefix + S] for S suffix rows: all of the prefix, and causal within the row's own suffix."""
    owner = segment_ids(torch.tensor([0, *itertools.accumulate(suffixes)], device=device))
    at = torch.arange(owner.numel(), device=device)
    own = (owner[:, None] == owner[None, :]) & (at[:, None] >= at[None, :])
    return torch.cat([own.new_ones(owner.numel(), prefix), own], dim=1)


def prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: tuple[PrefixBlock, ...],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Attention over a compressed row. query/key/value: [1, heads, R, dim] (fewer KV heads: GQA).
    Returns [1, heads, R, dim]."""
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    cuts = [part for b in blocks for part in (b.prefix, sum(b.suffix_lens))]
    qs, ks, vs = (x.split(cuts, dim=2) for x in (query, key, value))
    out = []
    for i, block in enumerate(blocks):
        q_p, k_p, v_p = qs[2 * i], ks[2 * i], vs[2 * i]
        out.append(
            F.scaled_dot_product_attention(
                q_p, k_p, v_p, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        )
        if block.mask is None:
            continue
        k = torch.cat([k_p, ks[2 * i + 1]], dim=2)
        v = torch.cat([v_p, vs[2 * i + 1]], dim=2)
        out.append(
            F.scaled_dot_product_attention(
                qs[2 * i + 1], k, v, attn_mask=block.mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        )
    return torch.cat(out, dim=2)
