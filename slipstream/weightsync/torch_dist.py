"""``torch_dist``: bucketed, double-buffered broadcasts over a torch.distributed group (gloo or NCCL).

One code path for CPU and GPU: the group (``groups.open_group``) uses gloo when the engine's device is the
CPU and NCCL when it is a GPU; buffers live on that device. Bucket metadata travels in-band on the same
group, so a receiver needs nothing but the group: per bucket the sender broadcasts a 4-integer header
(magic, kind, metadata length, payload length), the msgpack-encoded :class:`BucketMeta`, then the payload.
A header of kind ABORT tells receivers that the sender gave up on the version.

Pipelining: while bucket *i* is on the wire (the blocking waits run in a worker thread, so the event loop
stays free), a second worker thread packs bucket *i+1* into the other pool buffer. Receivers land each
payload straight in their staging memory (no unpacking copy) and yield its tensors as views.

Worked example: see :mod:`slipstream.weightsync.base`; with this engine ``build_topology`` gives the sender
rank 0 of a group of ``1 + len(receivers)`` and everyone the sender's store address.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterable

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import (
    CheckpointEngine,
    SendStats,
    WeightStream,
    register_engine,
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

MAGIC = 0x534C5057  # "SLPW"
KIND_BUCKET = 1
KIND_ABORT = 2
# Every bucket is announced by one fixed-size control broadcast (header + metadata), so a receiver can
# post it before knowing anything; metadata longer than that follows in a second broadcast.
CONTROL_BYTES = 64 << 10
HEADER_BYTES = 32
# Tensors this large are sent from the trainer's memory as their own segment, not copied into a bucket:
# on CPU a copy costs as much as the transfer itself, and on GPU it is still a needless pass over memory.
DIRECT_MIN_BYTES = 1 << 20
_meta_decoder = msgspec.msgpack.Decoder(BucketMeta)


@register_engine("torch_dist")
class TorchDistEngine(CheckpointEngine):
    """Sender or receiver of one torch.distributed weight group (see the module docstring)."""

    def __init__(self, cfg, *, is_sender: bool, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        self.group: DistGroup | None = None
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
        self._sock = None

    def finalize(self) -> None:
        if self.group is not None:
            self.group.close(barrier_timeout_s=min(10.0, self.cfg.timeout_s))
            self.group = None
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
        return Layout.slipstream(self.bucket_bytes, direct_min_bytes=DIRECT_MIN_BYTES)

    async def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SendStats:
        group = self._require_group()
        pool = self.pool
        assert pool is not None, "send_weights on a receiver"
        packer = BucketPacker(named_tensors, version, self.layout(), pool, timeout_s=self.cfg.timeout_s)
        stats = SendStats(version=version)
        start = time.perf_counter()

        async def send(bucket: PackedBucket) -> None:
            await asyncio.to_thread(self._send_bucket, group, bucket)

        try:
            await send_pipelined(packer, send, lambda b: pool.release(b.slot), stats)
        except TransferError:
            raise
        except Exception as err:
            await asyncio.to_thread(self._send_abort, group)
            raise TransferError(f"version {version}: packing failed ({err}); receivers dropped it") from err
        stats.tensors, stats.bytes = packer.tensors, packer.bytes
        stats.seconds = time.perf_counter() - start
        return stats

    def _send_bucket(self, group: DistGroup, bucket: PackedBucket) -> None:
        """Control message, then every payload segment, all in flight at once (runs in a worker thread)."""
        works = [group.broadcast_async(part) for part in _control(bucket.meta, group.device)]
        works += [group.broadcast_async(part) for _, part in bucket.payloads()]
        for work in works:
            group.wait(work, self.cfg.timeout_s)

    def _send_abort(self, group: DistGroup) -> None:
        control = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        control[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([MAGIC, KIND_ABORT, 0, 0]))
        try:
            group.broadcast(control.to(group.device), self.cfg.timeout_s)
        except TransferError as err:
            log.warning("could not tell receivers to drop the version: %s", err)

    # -- receiving

    def receive_weights(self) -> WeightStream:
        return WeightStream(self._receive)

    async def _receive(self, stream: WeightStream) -> AsyncIterator[tuple[str, torch.Tensor]]:
        group = self._require_group()
        staging = self.staging
        assert staging is not None, "receive_weights on a sender"
        while True:
            meta = await asyncio.to_thread(self._recv_meta, group)
            if stream.version is None:
                stream.version, stream.started = meta.version, time.perf_counter()
                staging.begin(meta.version)
            try:
                dest = staging.destination(meta)
            except BucketError as err:
                group.broken = True  # we cannot take part in the payload broadcast: the group is out of step
                raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
            await asyncio.to_thread(self._recv_payload, group, meta, dest)
            stream.nbytes += meta.nbytes
            for item in staging.commit(meta):
                yield item
            if meta.last:
                if not staging.complete:
                    raise TransferError(f"version {meta.version} ended with a tensor only partly received")
                return

    def _recv_meta(self, group: DistGroup) -> BucketMeta:
        control = torch.zeros(CONTROL_BYTES, dtype=torch.uint8, device=group.device)
        group.broadcast(control, self.cfg.timeout_s)
        control = control.cpu()
        magic, kind, meta_len, payload_len = control[:HEADER_BYTES].view(torch.int64).tolist()
        if magic != MAGIC:
            group.broken = True
            raise TransferError("bad bucket header (not a slipstream weight stream)")
        if kind == KIND_ABORT:
            raise TransferAborted("the sender dropped this version")
        raw = control[HEADER_BYTES : HEADER_BYTES + meta_len].numpy().tobytes()
        if meta_len > len(raw):
            rest = torch.empty(meta_len - len(raw), dtype=torch.uint8, device=group.device)
            group.broadcast(rest, self.cfg.timeout_s)
            raw += rest.cpu().numpy().tobytes()
        try:
            meta = _meta_decoder.decode(raw)
        except msgspec.DecodeError as err:
            group.broken = True
            raise TransferError(f"undecodable bucket metadata: {err}") from err
        if meta.nbytes != payload_len:
            group.broken = True
            raise TransferError(
                f"bucket {meta.index}: header says {payload_len} bytes, metadata {meta.nbytes}"
            )
        return meta

    def _recv_payload(self, group: DistGroup, meta: BucketMeta, dest: torch.Tensor) -> None:
        works = [group.broadcast_async(dest[off : off + n]) for off, n in segments_of(meta)]
        for work in works:
            group.wait(work, self.cfg.timeout_s)


def _control(meta: BucketMeta, device: torch.device) -> list[torch.Tensor]:
    """The control broadcast(s) announcing ``meta``: a fixed-size block, plus the rest of long metadata."""
    encoded = msgspec.msgpack.encode(meta)
    control = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    header = torch.tensor([MAGIC, KIND_BUCKET, len(encoded), meta.nbytes], dtype=torch.int64)
    control[:HEADER_BYTES].view(torch.int64).copy_(header)
    first = min(len(encoded), CONTROL_BYTES - HEADER_BYTES)
    control[HEADER_BYTES : HEADER_BYTES + first] = torch.frombuffer(
        bytearray(encoded[:first]), dtype=torch.uint8
    )
    parts = [control.to(device)]
    if first < len(encoded):
        parts.append(torch.frombuffer(bytearray(encoded[first:]), dtype=torch.uint8).to(device))
    return parts
