"""``naive``: one broadcast per tensor, each waited for before the next: the baseline.

This is what per-tensor weight sync does in most RL systems (one RPC naming the tensor, then one
broadcast of it): no packing, no overlap, a fixed latency paid hundreds of times per version. It shares
the group, the in-band metadata and the receive path of ``torch_dist``; each tensor is simply a bucket of
its own. ``slipstream bench weightsync`` measures the bucketed path against it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch

from slipstream.weightsync.base import SendStats, register_engine
from slipstream.weightsync.buckets import as_bytes, dtype_name
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.torch_dist import TorchDistEngine
from slipstream.weightsync.types import BucketMeta, TensorEntry


@register_engine("naive")
class NaiveEngine(TorchDistEngine):
    """Same group and receive side as :class:`TorchDistEngine`; sends tensor by tensor."""

    async def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SendStats:
        group = self._require_group()
        stats = SendStats(version=version)
        start = time.perf_counter()
        source = iter(named_tensors)
        index = 0
        try:
            item = next(source, None)
            while True:
                following = next(source, None) if item is not None else None
                if item is None:  # an empty version is one empty, final bucket
                    meta, data = BucketMeta(version=version, index=0, nbytes=0, entries=[], last=True), None
                else:
                    name, tensor = item
                    data = as_bytes(tensor).to(group.device)
                    entry = TensorEntry(name, dtype_name(tensor.dtype), list(tensor.shape), 0, data.numel())
                    meta = BucketMeta(
                        version=version,
                        index=index,
                        nbytes=data.numel(),
                        entries=[entry],
                        last=following is None,
                    )
                await asyncio.to_thread(self._send_bucket, group, meta, data)
                stats.buckets += 1
                stats.bytes += meta.nbytes
                stats.tensors += len(meta.entries)
                index += 1
                if meta.last:
                    break
                item = following
        except TransferError:
            raise
        except Exception as err:
            await asyncio.to_thread(self._send_abort, group)
            raise TransferError(
                f"version {version}: reading tensors failed ({err}); receivers dropped it"
            ) from err
        stats.seconds = time.perf_counter() - start
        return stats
