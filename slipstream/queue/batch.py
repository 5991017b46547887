"""Collation: leased groups → one packed training batch (a TensorDict), with no padding anywhere.

Every sample becomes ``prompt tokens + response tokens`` and the samples are laid end to end in one token
axis of length ``T``; ``cu_seqlens`` gives the boundaries, the layout flash-attention's varlen kernels and
the packed trainer take directly. Padding to the longest sample would waste compute in proportion to the
length spread, which in long-chain-of-thought RL is large.

Keys (``batch_size=[]``; token-level tensors have length ``T``, sample-level ones ``N``):

==================  ========  ========  =====================================================================
key                 dtype     shape     meaning
==================  ========  ========  =====================================================================
``input_ids``       int64     [T]       each sample's prompt then its response, samples concatenated
``position_ids``    int64     [T]       0, 1, ... restarting at every sample
``loss_mask``       bool      [T]       True on policy-generated tokens; False on prompt and tool tokens
``old_logprobs``    float32   [T]       behaviour log-prob of the token *at* that position; 0 elsewhere
``versions``        int32     [T]       weight version that generated the token; -1 on prompt tokens
``cu_seqlens``      int32     [N+1]     sample boundaries: sample i is ``[cu_seqlens[i], cu_seqlens[i+1])``
``prompt_lens``     int32     [N]       prompt tokens per sample
``response_lens``   int32     [N]       response tokens per sample
``rewards``         float32   [N]       the sample's reward
``min_versions``    int32     [N]       oldest version among the sample's tokens (staleness = v - this)
``group_index``     int64     [N]       index of the sample's group in ``groups``
``episode_index``   int64     [N]       index of the sample's episode: shared by the segments of one agent
                                        episode (``Trajectory.episode``), else one per sample
``uids``            (str)     N         non-tensor: the samples' uids
``group_ids``       (str)     N         non-tensor: each sample's group id
==================  ========  ========  =====================================================================

Groups with images (vision-language prompts) add their encoded images, once per group as they travelled:

==================  ========  ========  =====================================================================
``image_bytes``     uint8     [B]       every group's images end to end, groups in order
``image_nbytes``    int64     [I]       bytes of each image
``image_groups``    int64     [I]       index in ``groups`` of each image's group (its samples' group_index)
==================  ========  ========  =====================================================================

which the trainer turns into its model's pixel inputs (``trainer/engine/vision.py``, ``attach_pixels``).

Extra response-aligned tensors a producer attached to a group travel along under their own names, token
level, zero on prompt positions (shape ``[T, *rest]``).

Worked example: two groups, the first with samples a (prompt [1, 2], response [5, 6], versions [3, 4],
loss_mask [1, 1]) and b (prompt [1, 2], response [7], version [3]); the second with sample c (prompt [9],
response [8, 0, 4] where 0 is a tool token: loss_mask [1, 0, 1], versions [4, 4, 4])::

    input_ids     = [1, 2, 5, 6,  1, 2, 7,  9, 8, 0, 4]
    position_ids  = [0, 1, 2, 3,  0, 1, 2,  0, 1, 2, 3]
    loss_mask     = [F, F, T, T,  F, F, T,  F, T, F, T]
    versions      = [-1,-1,3, 4, -1,-1, 3, -1, 4, 4, 4]
    cu_seqlens    = [0, 4, 7, 11];  prompt_lens = [2, 2, 1];  response_lens = [2, 1, 3]
    min_versions  = [3, 3, 4];      group_index = [0, 0, 1];  episode_index = [0, 1, 2]
    uids = ["a", "b", "c"];  group_ids = ["g0", "g0", "g1"]

``old_logprobs[t]`` is log p(input_ids[t] | input_ids[:t]) under the behaviour policy, so a trainer that
computes logits at position t-1 compares them with ``old_logprobs[t]`` (shift by one).

Everything is copied out of the leased buffers, so the batch stays valid after the lease is acked.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorData, TensorDict

from slipstream.queue.types import COLUMN_DTYPES, IMAGE_COLUMN, ROUTE_COLUMNS, UNKNOWN_ROUTE, TrajectoryGroup

STANDARD_KEYS = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "old_logprobs",
    "versions",
    "cu_seqlens",
    "prompt_lens",
    "response_lens",
    "rewards",
    "min_versions",
    "group_index",
    "episode_index",
    "uids",
    "group_ids",
)


def _destinations(first: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Token positions ``first[i] + j`` for ``j < lens[i]``, all samples concatenated."""
    total = int(lens.sum())
    starts = torch.repeat_interleave(first, lens, output_size=total)
    local_start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
    return starts + torch.arange(total, dtype=torch.int64) - local_start


def collate(groups: list[TrajectoryGroup]) -> TensorDict:
    """Pack ``groups`` into one batch (see the module docstring for the layout and a worked example)."""
    if not groups:
        raise ValueError("collate needs at least one group")
    samples = [(gi, g.meta.group_id, s) for gi, g in enumerate(groups) for s in g.meta.samples]
    prompt_lens = torch.tensor([s.prompt_len for _, _, s in samples], dtype=torch.int64)
    response_lens = torch.tensor([s.response_len for _, _, s in samples], dtype=torch.int64)
    seq_lens = prompt_lens + response_lens
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    total = int(cu[-1])
    prompt_dst = _destinations(cu[:-1], prompt_lens)
    response_dst = _destinations(cu[:-1] + prompt_lens, response_lens)

    def column(name: str) -> torch.Tensor:
        return torch.cat([g.tensors[name] for g in groups])

    input_ids = torch.empty(total, dtype=torch.int64)
    input_ids[prompt_dst] = column("prompt_ids").to(torch.int64)
    input_ids[response_dst] = column("response_ids").to(torch.int64)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    loss_mask[response_dst] = column("loss_mask").bool()
    old_logprobs = torch.zeros(total, dtype=torch.float32)
    old_logprobs[response_dst] = column("logprobs").float()
    versions = torch.full((total,), -1, dtype=torch.int32)
    versions[response_dst] = column("versions").to(torch.int32)
    position_ids = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        cu[:-1], seq_lens, output_size=total
    )

    batch = TensorDict(
        {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
            "old_logprobs": old_logprobs,
            "versions": versions,
            "cu_seqlens": cu.to(torch.int32),
            "prompt_lens": prompt_lens.to(torch.int32),
            "response_lens": response_lens.to(torch.int32),
            "rewards": torch.tensor([s.reward for _, _, s in samples], dtype=torch.float32),
            "min_versions": torch.tensor([s.min_version for _, _, s in samples], dtype=torch.int32),
            "group_index": torch.tensor([gi for gi, _, _ in samples], dtype=torch.int64),
            "episode_index": _episode_index([s.episode or s.uid for _, _, s in samples]),
        },
        batch_size=[],
    )
    batch["uids"] = NonTensorData([s.uid for _, _, s in samples])
    batch["group_ids"] = NonTensorData([gid for _, gid, _ in samples])
    for name, extra in _extras(groups, response_dst, total).items():
        batch[name] = extra
    if "prompt_routes" in groups[0].tensors:
        batch["routed_experts"] = _routes(groups, prompt_dst, response_dst, total)
    if any(g.meta.image_nbytes for g in groups):
        batch.update(_images(groups))
    return batch


def _images(groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
    """The groups' images as they travelled, once per group (see the module docstring)."""
    nbytes = [n for g in groups for n in g.meta.image_nbytes]
    return {
        "image_bytes": torch.cat([g.tensors[IMAGE_COLUMN] for g in groups if g.meta.image_nbytes]).clone(),
        "image_nbytes": torch.tensor(nbytes, dtype=torch.int64),
        "image_groups": torch.tensor(
            [gi for gi, g in enumerate(groups) for _ in g.meta.image_nbytes], dtype=torch.int64
        ),
    }


def _routes(
    groups: list[TrajectoryGroup], prompt_dst: torch.Tensor, response_dst: torch.Tensor, total: int
) -> torch.Tensor:
    """``routed_experts`` [tokens, layers, k] int16 from the groups' route columns, -1 where unknown (the
    engine's router then picks; ``trainer/engine/moe.py``)."""
    missing = [g.group_id for g in groups if "prompt_routes" not in g.tensors]
    if missing:
        raise ValueError(f"groups {missing[:3]} carry no routes while others of the batch do")

    def rows(name: str) -> torch.Tensor:
        out = []
        for g in groups:
            col = g.tensors[name]
            unknown = col == UNKNOWN_ROUTE[col.dtype]
            out.append(col.to(torch.int16).masked_fill(unknown, -1))
        return torch.cat(out)

    prompt, response = rows("prompt_routes"), rows("response_routes")
    full = torch.full((total, *prompt.shape[1:]), -1, dtype=torch.int16)
    full[prompt_dst] = prompt
    full[response_dst] = response
    return full


def _episode_index(episodes: list[str]) -> torch.Tensor:
    """Each sample's episode as 0, 1, ... in order of first appearance."""
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(e, len(first)) for e in episodes], dtype=torch.int64)


def _extras(groups: list[TrajectoryGroup], response_dst: torch.Tensor, total: int) -> dict[str, torch.Tensor]:
    skip = {*COLUMN_DTYPES, *ROUTE_COLUMNS, IMAGE_COLUMN}
    names = [n for n in groups[0].tensors if n not in skip]
    out = {}
    for name in names:
        if name in STANDARD_KEYS or name in ("routed_experts", "image_bytes", "image_nbytes", "image_groups"):
            raise ValueError(f"extra tensor `{name}` would shadow the batch key of the same name; rename it")
        missing = [g.group_id for g in groups if name not in g.tensors]
        if missing:
            raise ValueError(f"extra tensor `{name}` is missing from group(s) {missing[:3]}")
        values = torch.cat([g.tensors[name] for g in groups])
        full = torch.zeros((total, *values.shape[1:]), dtype=values.dtype)
        full[response_dst] = values
        out[name] = full
    return out
