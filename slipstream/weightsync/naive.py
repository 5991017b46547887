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

from slipstream.weightsync.base import ENGINES, SendStats
from slipstream.weightsync.buckets import per_tensor_buckets
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.torch_dist import TorchDistEngine


@ENGINES.register("naive")
class NaiveEngine(TorchDistEngine):
    """Same group and receive side as :class:`TorchDistEngine`; sends tensor by tensor."""

    async def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SendStats:
        group = self._require_group()
        stats = SendStats(version=version)
        start = time.perf_counter()
        buckets = per_tensor_buckets(named_tensors, version, group.device)
        try:
            while (bucket := await asyncio.to_thread(next, buckets, None)) is not None:
                await asyncio.to_thread(self._send_bucket, group, bucket)
                stats.buckets += 1
                stats.bytes += bucket.meta.nbytes
                stats.tensors += len(bucket.meta.entries)
        except TransferError:
            raise
        except Exception as err:
            await asyncio.to_thread(self._send_abort, group)
            raise TransferError(
                f"version {version}: reading tensors failed ({err}); receivers dropped it"
            ) from err
        stats.seconds = time.perf_counter() - start
        return stats
