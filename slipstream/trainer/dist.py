"""Moving a step's batch between trainer ranks with plain torch.distributed collectives (no pickle).

Rank 0 is the only rank that talks to the queue: it leases whole groups, collates them, and broadcasts the
packed tensors (a small int64 header with the sizes first, the fixed keys, then any extra per-token tensors
described by a JSON spec; bool sent as uint8). Every
rank then holds the full step batch and computes the same plan from it (advantages over the full batch,
the same mini-batch and rank partitions), so nothing depends on how many ranks there are. Sample ids
(``uids``/``group_ids``) stay on rank 0, the only rank that acks.

Per-token results computed on rank shards (recomputed logprobs, critic values) are all-gathered back
into full-batch order with :func:`gather_tokens`.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from tensordict import TensorDict

from slipstream.utils.tensors import dtype_name, parse_dtype

# key -> dtype of the broadcast; (token-level, sample-level) is decided by batching.SAMPLE_KEYS.
BATCH_KEYS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.bool,
    "old_logprobs": torch.float32,
    "versions": torch.int32,
    "cu_seqlens": torch.int32,
    "prompt_lens": torch.int32,
    "response_lens": torch.int32,
    "rewards": torch.float32,
    "min_versions": torch.int32,
    "group_index": torch.int64,
}
OPTIONAL_KEYS: dict[str, torch.dtype] = {"ref_logprobs": torch.float32, "episode_index": torch.int64}


def broadcast_batch(
    batch: TensorDict | None, *, src: int = 0, device: torch.device | None = None
) -> TensorDict:
    """Rank ``src`` passes its batch; the others pass None and receive a copy (without uids/group_ids).

    Besides the fixed keys, every other tensor of the batch (an agent's extra per-token tensors, which
    :func:`~slipstream.queue.batch.collate` passes through, and an image batch's pixel inputs) travels too:
    its name, dtype and shape
    go first as a JSON spec in a byte tensor (no pickling), then its data.
    """
    device = device or torch.device("cpu")
    rank = dist.get_rank()
    optional = list(OPTIONAL_KEYS)
    spec = b""
    if rank == src:
        extras = [
            k
            for k in batch.keys()
            if k not in BATCH_KEYS and k not in OPTIONAL_KEYS and isinstance(batch.get(k), torch.Tensor)
        ]
        # full shapes: an image batch's pixel_values, grids and image_counts are not per token
        spec = json.dumps([[k, dtype_name(batch[k].dtype), list(batch[k].shape)] for k in extras]).encode()
        header = torch.tensor(
            [batch["input_ids"].numel(), batch["cu_seqlens"].numel() - 1, len(spec)]
            + [int(k in batch.keys()) for k in optional],
            dtype=torch.int64,
        )
    else:
        header = torch.zeros(3 + len(optional), dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src)
    t, n, spec_len = int(header[0]), int(header[1]), int(header[2])
    present = [k for k, flag in zip(optional, header[3:].tolist(), strict=True) if flag]
    keys = {**BATCH_KEYS, **{k: OPTIONAL_KEYS[k] for k in present}}
    out: dict[str, torch.Tensor] = {}
    for key, dtype in keys.items():
        size = n + 1 if key == "cu_seqlens" else (n if _per_sample(key) else t)
        out[key] = _broadcast_tensor(batch[key] if rank == src else None, (size,), dtype, src, device)
    if spec_len:
        raw = torch.frombuffer(bytearray(spec), dtype=torch.uint8) if rank == src else None
        raw = _broadcast_tensor(raw, (spec_len,), torch.uint8, src, device)
        for key, name, shape in json.loads(raw.numpy().tobytes()):
            dtype = parse_dtype(name)
            out[key] = _broadcast_tensor(
                batch[key] if rank == src else None, tuple(shape), dtype, src, device
            )
    td = TensorDict(out, batch_size=[])
    if rank == src:
        for key in ("uids", "group_ids"):
            if key in batch.keys():
                td.set_non_tensor(key, batch.get_non_tensor(key))
    return td


def _broadcast_tensor(
    tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device
) -> torch.Tensor:
    """``tensor`` from rank ``src`` (None elsewhere) to every rank, as a CPU tensor of ``dtype``."""
    wire = torch.uint8 if dtype == torch.bool else dtype
    if tensor is not None:
        buf = tensor.to(device=device, dtype=wire).contiguous()
    else:
        buf = torch.empty(shape, dtype=wire, device=device)
    dist.broadcast(buf, src)
    return buf.to(dtype).cpu()


def _per_sample(key: str) -> bool:
    from slipstream.trainer.batching import SAMPLE_KEYS

    return key in SAMPLE_KEYS


def gather_tokens(
    local: torch.Tensor,
    parts: list[list[int]],
    lengths: list[int],
    *,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Full-batch [T] tensor from every data-parallel replica's shard values.

    ``parts[r]`` are the sample indices replica r holds (in shard order) and ``lengths`` every sample's
    token count; shards are padded to the longest for ``all_gather`` over ``group`` (default: the world)
    and unpadded here.
    """
    device = device or torch.device("cpu")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        order = [i for p in parts for i in p]
        return _reorder(local, order, lengths)
    sizes = [sum(lengths[i] for i in p) for p in parts]
    width = max(sizes)
    padded = torch.zeros(width, dtype=local.dtype, device=device)
    padded[: local.numel()] = local.to(device)
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    flat = torch.cat([b[:s].cpu() for b, s in zip(bufs, sizes, strict=True)])
    return _reorder(flat, [i for p in parts for i in p], lengths)


def _reorder(flat: torch.Tensor, order: list[int], lengths: list[int]) -> torch.Tensor:
    """``flat`` holds samples in ``order``; return them in index order 0..N-1."""
    pieces: dict[int, torch.Tensor] = {}
    offset = 0
    for i in order:
        pieces[i] = flat[offset : offset + lengths[i]]
        offset += lengths[i]
    return torch.cat([pieces[i] for i in range(len(lengths))]) if lengths else flat[:0]
