"""Cutting a packed batch into rank shards, mini-batches and micro-batches without ever padding.

The layout (``slipstream.queue.batch.collate``): a ``TensorDict`` with empty batch size whose *token* tensors
(``input_ids``, ``position_ids``, ``loss_mask``, ``old_logprobs``, ``versions``, ``advantages``, ...) are flat
``[T]`` with samples end to end, and whose *sample* tensors (``cu_seqlens`` [N+1] and the ones named in
``SAMPLE_KEYS``) have one entry per sample. Non-tensor entries (``uids``, ``group_ids``) are lists per sample.

Why hand-written rather than TensorDict's batch dimension: the two kinds of tensors have different leading
sizes (T and N) and a sample's tokens are a variable-length slice, which a fixed batch dimension cannot
express without padding, the thing packing exists to avoid.

Every split here is deterministic (a function of lengths only), so all ranks compute the same plan from
the same batch without talking to each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

# Per-sample keys (one entry per sample); cu_seqlens is handled separately. Every other tensor is per token.
SAMPLE_KEYS = frozenset(
    {
        "prompt_lens",
        "response_lens",
        "rewards",
        "min_versions",
        "group_index",
        "episode_index",
        "sample_weight",
        "staleness",
        "image_counts",
    }
)
NON_TENSOR_KEYS = ("uids", "group_ids")
# A vision-language batch's images (trainer/engine/vision.py): per image (its patch grid) and per patch (its
# pixels), in sample order; ``image_counts`` (per sample) says whose they are.
IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})


def sample_lengths(batch: TensorDict) -> list[int]:
    cu = batch["cu_seqlens"]
    return (cu[1:] - cu[:-1]).tolist()


def num_samples(batch: TensorDict) -> int:
    return int(batch["cu_seqlens"].numel()) - 1


def _is_sample_key(key: str) -> bool:
    return key in SAMPLE_KEYS


def select_samples(batch: TensorDict, indices: Sequence[int]) -> TensorDict:
    """A new packed batch holding the given samples in the given order (copies token data once)."""
    cu = batch["cu_seqlens"].long()
    idx = torch.as_tensor(list(indices), dtype=torch.long)
    starts, ends = cu[:-1][idx], cu[1:][idx]
    lengths = ends - starts
    token_idx = (
        torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends, strict=True)])
        if len(idx)
        else torch.zeros(0, dtype=torch.long)
    )
    out: dict[str, object] = {}
    for key, value in batch.items():
        if key == "cu_seqlens" or key in IMAGE_KEYS or not isinstance(value, torch.Tensor):
            continue
        out[key] = value[idx] if _is_sample_key(key) else value[token_idx]
    if "image_grid_thw" in batch.keys():
        out.update(_select_images(batch, idx))
    new_cu = torch.zeros(len(idx) + 1, dtype=batch["cu_seqlens"].dtype)
    new_cu[1:] = lengths.cumsum(0)
    out["cu_seqlens"] = new_cu
    td = TensorDict(out, batch_size=[])
    for key in NON_TENSOR_KEYS:
        if key in batch.keys():
            values = batch.get_non_tensor(key)
            td.set_non_tensor(key, [values[i] for i in idx.tolist()])
    return td


def truncate_to_one_token(batch: TensorDict) -> TensorDict:
    """The first token of the first sample as a batch of its own: the body of a zero-weight micro-batch."""
    first = select_samples(batch, [0])
    out = {
        k: (v if _is_sample_key(k) or k == "cu_seqlens" else v[:1])
        for k, v in first.items()
        if isinstance(v, torch.Tensor) and k not in IMAGE_KEYS
    }
    out["cu_seqlens"] = torch.tensor([0, 1], dtype=first["cu_seqlens"].dtype)
    if "image_counts" in out:  # one token is never a whole image: the body runs as text
        out["image_counts"] = torch.zeros_like(out["image_counts"])
    return TensorDict(out, batch_size=[])


def _select_images(batch: TensorDict, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The grids and patches of the samples ``idx``, in that order."""
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    counts = batch["image_counts"].long()
    first_image = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    patches = grids.long().prod(-1)
    first_patch = torch.cat([patches.new_zeros(1), patches.cumsum(0)])
    images = [torch.arange(int(first_image[i]), int(first_image[i + 1])) for i in idx.tolist()]
    image_idx = torch.cat(images) if images else torch.zeros(0, dtype=torch.long)
    patch_idx = [torch.arange(int(first_patch[j]), int(first_patch[j + 1])) for j in image_idx.tolist()]
    patch_idx = torch.cat(patch_idx) if patch_idx else torch.zeros(0, dtype=torch.long)
    return {"image_grid_thw": grids[image_idx], "pixel_values": pixels[patch_idx]}


def split_by_token_budget(lengths: Sequence[int], budget: int, *, padded: bool = False) -> list[list[int]]:
    """Consecutive sample indices grouped so each group's tokens fit ``budget``.

    Packed: a group costs the sum of its lengths. ``padded=True``: a group costs ``count * max(lengths)``
    (every row padded to the longest sample of the whole batch). A sample longer than the budget gets a
    micro-batch of its own. Order is kept, so outputs re-assemble by concatenation.
    """
    pad_to = max(lengths, default=0)
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        cost = pad_to if padded else n
        if current and used + cost > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += cost
    if current:
        groups.append(current)
    return groups


def partition_for_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Balance samples over ranks by token count (longest first onto the least-loaded rank).

    Each rank's list is sorted ascending so its shard keeps batch order. Raises when there are fewer samples
    than ranks: every rank needs at least one sample to shape its zero-weight padding micro-batches.
    """
    if len(lengths) < world_size:
        raise ValueError(f"a mini-batch of {len(lengths)} samples cannot feed {world_size} ranks")
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def split_groups(group_index: torch.Tensor, parts: int) -> list[list[int]]:
    """Sample indices of ``parts`` mini-batches made of whole groups (contiguous runs of groups).

    Whole groups keep each mini-batch's samples of one prompt together; sizes differ by at most one group.
    """
    groups: list[list[int]] = []
    for i, g in enumerate(group_index.tolist()):
        if not groups or group_index[groups[-1][0]].item() != g:
            groups.append([])
        groups[-1].append(i)
    if parts > len(groups):
        raise ValueError(
            f"cannot split {len(groups)} groups into {parts} mini-batches (trainer.mini_batches)"
        )
    bounds = [round(k * len(groups) / parts) for k in range(parts + 1)]
    return [[i for g in groups[bounds[k] : bounds[k + 1]] for i in g] for k in range(parts)]
