"""``torch_dist``: bucketed, double-buffered broadcasts over a torch.distributed group (gloo or NCCL).

One code path for CPU and GPU: the group (``groups.open_group``) uses gloo when the transport's device is
the CPU and NCCL when it is a GPU; buffers live on that device. Each bucket is exactly one broadcast (plus,
on GPU, one per large tensor sent from its own memory).

Metadata, in band: it does not take a collective of its own: measured on gloo, one extra small broadcast
per bucket cost a fifth of the bandwidth, because the next payload waits behind it on the same connection.
Metadata goes beside the data instead, as msgpack bytes under one key per bucket in the group's own
TCPStore (:class:`MetaChannel`), which receivers read ahead. Out of band (``announce``): a server's HTTP
update call carries each bucket's metadata (SGLang's ``/update_weights_from_distributed``, our embedded
server's ``slipstream_bucket``) and its receiver lands the bucket with ``receive_bucket``.

Pipelining: two buckets are in flight at once, and while they drain a worker thread packs the next one
into the buffer that frees first; receivers post bucket *i+1*'s payload before bucket *i*'s has landed,
straight into their staging memory (no unpacking copy), and yield its tensors as views. The ``naive``
baseline is this transport with ``layout=None``: one broadcast per tensor, each waited for.

Worked example: see :mod:`slipstream.weightsync.base`; :func:`~slipstream.weightsync.base.build_topology`
gives the sender rank 0 of a group of ``1 + len(receivers)`` and everyone the sender's store address.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import TRANSPORTS, Transport, WeightStream
from slipstream.weightsync.buckets import (
    BucketError,
    BufferPool,
    Layout,
    PackedBucket,
    StagingArea,
    parse_dtype,
    segments_of,
)
from slipstream.weightsync.errors import TransferAborted, TransferError
from slipstream.weightsync.groups import (
    DistGroup,
    backend_for_device,
    device_for_backend,
    open_group,
    reserve_port,
)
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

    def post_ready(self, version: int, rank: int, refusal: str = "") -> None:
        """A receiver has prepared ``version`` (``refusal``: why it will not apply it), so the sender may
        switch it in without the switch waiting for the receiver's own preparation."""
        try:
            self.store.set(f"ready/{version}/{rank}", b"R" + refusal.encode()[:4000])
        except RuntimeError as err:
            raise TransferError(f"posting that version {version} is ready: {err}") from err

    def wait_ready(self, version: int, ranks: range) -> None:
        """Wait until every receiver rank posted :meth:`post_ready` for ``version``; TransferError naming the
        refusals, or the ranks that did not answer in time."""
        keys = [f"ready/{version}/{rank}" for rank in ranks]
        try:
            self.store.wait(keys, self.timeout)
            answers = [bytes(self.store.get(key))[1:].decode(errors="replace") for key in keys]
        except RuntimeError as err:
            raise TransferError(f"waiting for the receivers to prepare version {version}: {err}") from err
        for key in keys:
            try:
                self.store.delete_key(key)
            except RuntimeError as err:
                log.debug("deleting %s: %s", key, err)
        refusals = [f"rank {rank}: {why}" for rank, why in zip(ranks, answers, strict=True) if why]
        if refusals:
            raise TransferError(f"version {version} refused: " + "; ".join(refusals))

    def refusals(self, version: int, ranks: range) -> list[str]:
        """The refusals of ``version`` posted so far, without waiting (after a send that failed: a receiver
        that refused a bucket leaves the broadcast, and its reason is the one worth reporting)."""
        out = []
        for rank in ranks:
            key = f"ready/{version}/{rank}"
            try:
                if self.store.check([key]):
                    why = bytes(self.store.get(key))[1:].decode(errors="replace")
                    if why:
                        out.append(f"rank {rank}: {why}")
            except RuntimeError as err:
                log.debug("reading %s: %s", key, err)
        return out

    def _set(self, value: bytes) -> None:
        key = str(self.seq)
        try:
            self.store.set(key, value)
        except RuntimeError as err:
            raise TransferError(f"posting bucket metadata #{key}: {err}") from err
        self._posted.append(key)
        self.seq += 1


@TRANSPORTS.register("torch_dist")
class TorchDistTransport(Transport):
    """Sender or receiver of one torch.distributed weight group (see the module docstring).

    In band, metadata goes through the group's store (:class:`MetaChannel`) and two buckets are in flight;
    out of band (``announce``), each bucket is one broadcast matched by the receivers' ``receive_bucket``
    (an SGLang server's ``/update_weights_from_distributed``). ``typed``: send a single-dtype bucket as
    one typed tensor, as SGLang's NCCL receiver expects (ours and gloo take plain bytes).
    """

    def __init__(
        self, cfg, *, is_sender: bool, device: str | torch.device | None = None, typed: bool = False
    ) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        self.typed = typed
        self.group: DistGroup | None = None
        self.meta: MetaChannel | None = None
        self._sock: socket.socket | None = None
        self.pool = BufferPool(self.device) if is_sender else None
        self.staging = None if is_sender else StagingArea(self.device)

    @classmethod
    def for_backend(cls, cfg, backend: str) -> TorchDistTransport:
        """A receiving end on the device a process-group backend implies (gloo: CPU, NCCL: this GPU)."""
        return cls(cfg, is_sender=False, device=device_for_backend(backend))

    @property
    def group_name(self) -> str:
        return self.group.group_name if self.group is not None else ""

    # -- rendezvous

    def prepare(self) -> Rendezvous:
        if not self.is_sender:
            return Rendezvous(backend=self.name)
        if self._sock is None:
            self._sock = reserve_port(self.cfg.master_address, self.cfg.master_port)
        return Rendezvous(
            backend=self.name, address=self.cfg.master_address, port=self._sock.getsockname()[1]
        )

    def connect(self, info: InitInfo) -> None:
        if (info.rank == 0) != self.is_sender:
            raise ValueError(f"rank {info.rank} given to a {'sender' if self.is_sender else 'receiver'}")
        if self.is_sender and self._sock is None:
            raise RuntimeError("call prepare() on the sender before connect()")
        if self.group is not None:  # a rebuild (a receiver joined or left): everyone re-joins at once
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

    def fail(self) -> None:
        """Tear the group down at once (peers blocked in a broadcast then fail instead of waiting)."""
        if self.group is not None:
            self.group.broken = True
            self.group.close(0)

    def type_buckets(self, typed: bool) -> None:
        # Only NCCL types its broadcasts; gloo (and our receivers) take plain bytes.
        self.typed = typed and backend_for_device(self.device) == "nccl"

    def leave_servers(self) -> None:
        self.close(barrier_timeout_s=0)  # SGLang's destroy never joins a barrier

    def close(self, barrier_timeout_s: float | None = None) -> None:
        """Leave the group; a healthy one first meets its peers at a barrier (``barrier_timeout_s``, default
        10 s; 0 where the peers never join one, as SGLang's destroy does not)."""
        if self.group is not None:
            wait = min(10.0, self.cfg.timeout_s) if barrier_timeout_s is None else barrier_timeout_s
            self.group.close(barrier_timeout_s=wait)
            self.group = None
            self.meta = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _require_group(self) -> DistGroup:
        if self.group is None:
            raise TransferError(f"{self.name}: no group (call prepare/connect first)")
        if self.group.broken:
            raise TransferError(f"{self.name}: the group broke in an earlier transfer; rebuild it")
        return self.group

    # -- sending

    def layout(self) -> Layout:
        direct = DIRECT_MIN_BYTES if self.device.type == "cuda" else self.bucket_bytes // 2
        return Layout.slipstream(self.bucket_bytes, direct_min_bytes=direct)

    def _before_send(self, version: int) -> None:
        self._require_group()
        if self.meta is not None:
            self.meta.forget_posted()

    def start_bucket(self, bucket: PackedBucket) -> Awaitable[None]:
        group = self._require_group()
        self.meta.post(bucket.meta)  # in order, from the event loop: issue order is matching order
        works = [group.broadcast_async(part) for _, part in bucket.payloads()]
        return asyncio.to_thread(self._wait_all, group, works)

    def send_payload(self, bucket: PackedBucket) -> None:
        group = self._require_group()
        parts = [part for _, part in bucket.payloads()]
        if self.typed and bucket.meta.entries and len(parts) == 1:
            dtype = parse_dtype(bucket.meta.entries[0].dtype)
            if parts[0].numel() % dtype.itemsize == 0:
                parts = [parts[0].view(dtype)]
        self._wait_all(group, [group.broadcast_async(part) for part in parts])

    def _wait_all(self, group: DistGroup, works: list) -> None:
        for work in works:
            group.wait(work, self.cfg.timeout_s)

    def _abort(self, version: int, err: BaseException) -> None:
        if isinstance(err, TransferError) or self.meta is None:
            return  # the group is broken: receivers fail on it already
        try:
            self.meta.post_abort()
        except TransferError as post_err:
            log.warning("could not tell receivers to drop the version: %s", post_err)

    def wait_prepared(self, version: int) -> None:
        """Sender: wait until every receiver prepared ``version`` (:meth:`MetaChannel.wait_ready`)."""
        group = self._require_group()
        assert self.meta is not None
        self.meta.wait_ready(version, range(1, group.world_size))

    def refusals(self, version: int) -> list[str]:
        """Sender: the receivers' refusals of ``version`` posted so far (:meth:`MetaChannel.refusals`)."""
        if self.group is None or self.meta is None:
            return []
        return self.meta.refusals(version, range(1, self.group.world_size))

    # -- receiving

    def mark_prepared(self, version: int, refusal: str = "") -> None:
        """Receiver: tell the sender ``version`` is prepared (or why it is refused)."""
        group = self._require_group()
        assert self.meta is not None
        self.meta.post_ready(version, group.rank, refusal)

    def receive_weights(self) -> WeightStream:
        return WeightStream(self._receive)

    async def _receive(self, stream: WeightStream) -> AsyncIterator[tuple[str, torch.Tensor]]:
        group = self._require_group()
        staging, channel = self.staging, self.meta
        if staging is None or channel is None:
            raise TransferError("receive_weights on a sending end")
        stream.staging = staging
        meta = await asyncio.to_thread(channel.take)
        stream.version, stream.started = meta.version, time.perf_counter()
        staging.begin(meta.version)
        works = self._post_payload(group, staging, meta)
        while True:
            following = None
            if not meta.last:  # read ahead: bucket i+1 is posted before bucket i has landed
                following = await asyncio.to_thread(channel.take)
                following_works = self._post_payload(group, staging, following)
            await asyncio.to_thread(self._wait_all, group, works)
            stream.nbytes += meta.nbytes
            try:
                done = staging.commit(meta)
            except BucketError as err:  # a digest that does not match: the version is dropped, as any failure
                raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
            for item in done:
                yield item
            if following is None:
                if not staging.complete:
                    raise TransferError(f"version {meta.version} ended with a tensor only partly received")
                return
            meta, works = following, following_works

    def receive_bucket(self, meta: BucketMeta, staging: StagingArea) -> list[tuple[str, torch.Tensor]]:
        """Land one bucket announced out of band (every segment posted at once) into ``staging``."""
        group = self._require_group()
        self._wait_all(group, self._post_payload(group, staging, meta))
        return staging.commit(meta)

    def _post_payload(self, group: DistGroup, staging: StagingArea, meta: BucketMeta) -> list:
        if meta.version != staging.version:
            group.broken = True
            raise TransferError(f"bucket of version {meta.version} inside version {staging.version}")
        try:
            dest = staging.destination(meta)
        except BucketError as err:
            group.broken = True  # we cannot take part in the payload broadcast: the group is out of step
            raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
        return [group.broadcast_async(dest[off : off + n]) for off, n in segments_of(meta)]
