"""``torch_dist``: bucketed, double-buffered broadcasts over a torch.distributed group (gloo or NCCL).

One code path for CPU and GPU: the group (``groups.open_group``) uses gloo when the engine's device is the
CPU and NCCL when it is a GPU; buffers live on that device. Each bucket is exactly one broadcast (plus, on
GPU, one per large tensor sent from its own memory). Its metadata does not take a collective of its own:
measured on gloo, one extra small broadcast per bucket cost a fifth of the bandwidth, because the next
payload waits behind it on the same connection. Metadata goes beside the data instead, as msgpack bytes
under one key per bucket in the group's own TCPStore (:class:`MetaChannel`), which receivers read ahead.

Pipelining: two buckets are in flight at once, and while they drain a worker thread packs the next one
into the buffer that frees first; receivers post bucket *i+1*'s payload before bucket *i*'s has landed,
straight into their staging memory (no unpacking copy), and yield its tensors as views.

Worked example: see :mod:`slipstream.weightsync.base`; with this engine ``build_topology`` gives the sender
rank 0 of a group of ``1 + len(receivers)`` and everyone the sender's store address.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import (
    ENGINES,
    CheckpointEngine,
    SendStats,
    WeightStream,
    send_pipelined,
)
from slipstream.weightsync.buckets import (
    BucketError,
    BucketPacker,
    BufferPool,
    Layout,
    PackedBucket,
    StagingArea,
    segments_of,
)
from slipstream.weightsync.errors import TransferAborted, TransferError
from slipstream.weightsync.groups import DistGroup, backend_for_device, open_group, reserve_port
from slipstream.weightsync.types import BucketMeta, InitInfo, Rendezvous

log = get_logger(__name__)

# Tensors this large are sent from the trainer's memory as their own broadcast instead of being copied into
# a bucket. On GPU from 1 MiB: NCCL's per-call cost is small and the copy a needless pass over memory. On
# gloo only tensors of at least half a bucket (and the chunks of larger ones, which are whole buckets
# anyway): there every extra collective costs more than copying a few MiB, but on a CPU a copy of the big
# tensors costs as much as sending them.
DIRECT_MIN_BYTES = 1 << 20
_meta_decoder = msgspec.msgpack.Decoder(BucketMeta)


class MetaChannel:
    """Bucket metadata beside the data: one key per bucket in the group's TCPStore, read in order.

    Both sides count buckets the same way (``seq``), so a receiver knows the key of the next bucket before
    it exists and waits for it (bounded by ``timeout_s``). Values are a kind byte (``B`` bucket, ``A``
    abort) and the msgpack :class:`BucketMeta`. The sender deletes a version's keys when the next one
    starts (every receiver has read them by then: it could not receive a payload otherwise).
    """

    def __init__(self, group: DistGroup, timeout_s: float) -> None:
        if group.store is None:
            raise TransferError(f"group `{group.group_name}` has no store for bucket metadata")
        self.store = dist.PrefixStore(f"{group.group_name}/meta/", group.store)
        self.timeout = timedelta(seconds=timeout_s)
        self.seq = 0
        self._posted: list[str] = []

    def post(self, meta: BucketMeta) -> None:
        self._set(b"B" + msgspec.msgpack.encode(meta))

    def post_abort(self) -> None:
        self._set(b"A")

    def forget_posted(self) -> None:
        for key in self._posted:
            try:
                self.store.delete_key(key)
            except RuntimeError as err:
                log.debug("deleting metadata key %s: %s", key, err)
        self._posted = []

    def take(self) -> BucketMeta:
        """The next bucket's metadata (blocks until the sender posts it); TransferAborted on an abort."""
        key = str(self.seq)
        try:
            self.store.wait([key], self.timeout)
            raw = bytes(self.store.get(key))
        except RuntimeError as err:  # the sender's store is gone, or the wait timed out
            raise TransferError(f"bucket metadata #{key}: {str(err).splitlines()[0][:200]}") from err
        self.seq += 1
        if raw[:1] == b"A":
            raise TransferAborted("the sender dropped this version")
        try:
            return _meta_decoder.decode(raw[1:])
        except msgspec.DecodeError as err:
            raise TransferError(f"undecodable bucket metadata: {err}") from err

    def _set(self, value: bytes) -> None:
        key = str(self.seq)
        try:
            self.store.set(key, value)
        except RuntimeError as err:
            raise TransferError(f"posting bucket metadata #{key}: {err}") from err
        self._posted.append(key)
        self.seq += 1


@ENGINES.register("torch_dist")
class TorchDistEngine(CheckpointEngine):
    """Sender or receiver of one torch.distributed weight group (see the module docstring)."""

    def __init__(self, cfg, *, is_sender: bool, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        self.group: DistGroup | None = None
        self.meta: MetaChannel | None = None
        self._sock: socket.socket | None = None
        self.pool = BufferPool(self.device) if is_sender else None
        self.staging = None if is_sender else StagingArea(self.device)

    # -- rendezvous

    def prepare(self) -> Rendezvous:
        if not self.is_sender:
            return Rendezvous(backend=self.name)
        if self._sock is None:
            self._sock = reserve_port(self.cfg.master_address, self.cfg.master_port)
        return Rendezvous(
            backend=self.name, address=self.cfg.master_address, port=self._sock.getsockname()[1]
        )

    @classmethod
    def build_topology(
        cls, sender: Rendezvous, receivers: list[Rendezvous], group_name: str = "slipstream_weights"
    ) -> tuple[InitInfo, list[InitInfo]]:
        world = 1 + len(receivers)

        def info(rank: int) -> InitInfo:
            return InitInfo(
                backend=cls.name,
                rank=rank,
                world_size=world,
                group_name=group_name,
                address=sender.address,
                port=sender.port,
            )

        return info(0), [info(i + 1) for i in range(len(receivers))]

    def init_process_group(self, info: InitInfo) -> None:
        if (info.rank == 0) != self.is_sender:
            raise ValueError(f"rank {info.rank} given to a {'sender' if self.is_sender else 'receiver'}")
        if self.is_sender and self._sock is None:
            raise RuntimeError("call prepare() on the sender before init_process_group()")
        if self.group is not None:  # a rebuild (a receiver joined or left): everyone re-inits at once
            self.group.close(barrier_timeout_s=0)
            self.group = None
        self.group = open_group(
            master_address=info.address,
            master_port=info.port,
            rank=info.rank,
            world_size=info.world_size,
            group_name=info.group_name,
            backend=backend_for_device(self.device),
            timeout_s=self.cfg.timeout_s,
            listen_socket=self._sock,
        )
        self.meta = MetaChannel(self.group, self.cfg.timeout_s)
        self._sock = None

    def finalize(self) -> None:
        if self.group is not None:
            self.group.close(barrier_timeout_s=min(10.0, self.cfg.timeout_s))
            self.group = None
            self.meta = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _require_group(self) -> DistGroup:
        if self.group is None:
            raise TransferError(f"{self.name}: no group (call prepare/init_process_group first)")
        if self.group.broken:
            raise TransferError(f"{self.name}: the group broke in an earlier transfer; rebuild it")
        return self.group

    # -- sending

    def layout(self) -> Layout:
        direct = DIRECT_MIN_BYTES if self.device.type == "cuda" else self.bucket_bytes // 2
        return Layout.slipstream(self.bucket_bytes, direct_min_bytes=direct)

    async def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SendStats:
        group = self._require_group()
        pool = self.pool
        assert pool is not None, "send_weights on a receiver"
        packer = BucketPacker(named_tensors, version, self.layout(), pool, timeout_s=self.cfg.timeout_s)
        stats = SendStats(version=version)
        start = time.perf_counter()
        self.meta.forget_posted()

        def begin(bucket: PackedBucket):
            works = self._issue_bucket(group, bucket)  # in order, from this thread: order is matching
            return asyncio.to_thread(self._wait_all, group, works)

        try:
            # Two buckets in flight: the group carries bucket i+1's control message and payload while
            # bucket i's are still draining, so the wire never idles between buckets.
            await send_pipelined(packer, begin, lambda b: pool.release(b.slot), stats, depth=2)
        except TransferError:
            raise
        except Exception as err:
            await asyncio.to_thread(self._send_abort, group)
            raise TransferError(f"version {version}: packing failed ({err}); receivers dropped it") from err
        stats.tensors, stats.bytes = packer.tensors, packer.bytes
        stats.seconds = time.perf_counter() - start
        return stats

    def _issue_bucket(self, group: DistGroup, bucket: PackedBucket) -> list:
        """Post the bucket's metadata and start every payload broadcast; returns their works."""
        self.meta.post(bucket.meta)
        return [group.broadcast_async(part) for _, part in bucket.payloads()]

    def _send_bucket(self, group: DistGroup, bucket: PackedBucket) -> None:
        self._wait_all(group, self._issue_bucket(group, bucket))

    def _wait_all(self, group: DistGroup, works: list) -> None:
        for work in works:
            group.wait(work, self.cfg.timeout_s)

    def _send_abort(self, group: DistGroup) -> None:
        try:
            self.meta.post_abort()
        except TransferError as err:
            log.warning("could not tell receivers to drop the version: %s", err)

    # -- receiving

    def receive_weights(self) -> WeightStream:
        return WeightStream(self._receive)

    async def _receive(self, stream: WeightStream) -> AsyncIterator[tuple[str, torch.Tensor]]:
        group = self._require_group()
        staging, channel = self.staging, self.meta
        assert staging is not None and channel is not None, "receive_weights on a sender"
        meta = await asyncio.to_thread(channel.take)
        stream.version, stream.started = meta.version, time.perf_counter()
        staging.begin(meta.version)
        works = self._post_payload(group, meta)
        while True:
            following = None
            if not meta.last:  # read ahead: bucket i+1 is posted before bucket i has landed
                following = await asyncio.to_thread(channel.take)
                following_works = self._post_payload(group, following)
            await asyncio.to_thread(self._wait_all, group, works)
            stream.nbytes += meta.nbytes
            for item in staging.commit(meta):
                yield item
            if following is None:
                if not staging.complete:
                    raise TransferError(f"version {meta.version} ended with a tensor only partly received")
                return
            meta, works = following, following_works

    def _post_payload(self, group: DistGroup, meta: BucketMeta) -> list:
        if meta.version != self.staging.version:
            group.broken = True
            raise TransferError(f"bucket of version {meta.version} inside version {self.staging.version}")
        try:
            dest = self.staging.destination(meta)
        except BucketError as err:
            group.broken = True  # we cannot take part in the payload broadcast: the group is out of step
            raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
        return [group.broadcast_async(dest[off : off + n]) for off, n in segments_of(meta)]
