"""The weight transport: one interface for every way a weight version moves from trainer rank 0 to receivers.

One sender (trainer rank 0) pushes each version to a fixed set of receivers (one inference server each, or
its workers). Every transport is used in the same four steps, on both ends:

1. ``prepare()`` returns a :class:`Rendezvous`: a msgspec Struct that travels as bytes (our HTTP routes,
   pipes, vLLM's ``/init_weight_transfer_engine`` body), never pickled;
2. whoever wires the two sides calls :func:`build_topology` (one function for every transport), which gives
   each end its :class:`InitInfo` (rank, world size, peers);
3. ``connect(info)`` on every end, concurrently (it returns once all have joined);
4. per version, the sender ``await send_weights(named_tensors, version)``: the tensors are packed into
   buckets (``buckets.py``) and sent double-buffered (bucket *i+1* is packed while bucket *i* is on the
   wire, :func:`send_pipelined`); each receiver takes the version with :func:`receive_version`, which stages
   every bucket and hands the whole version to a ``load`` callback only once it is complete (all or none);
   ``close()`` when done, ``fail()`` to tear down at once after an error (then back to step 1).

Metadata (a :class:`BucketMeta` per bucket: names, dtypes, shapes, offsets and each entry's ``kind``) goes
one of two ways. In band (the default): the transport carries it itself (torch_dist: the group's TCPStore;
ipc: its control socket; nixl: NIXL notifications) and a receiver iterates ``receive_weights()``. Out of
band: the sender passes ``announce``, a coroutine that hands one bucket's metadata to every receiver (an
SGLang or vLLM server's blocking HTTP update call) and returns once they all landed it; the receiver then
lands each bucket it is told about with ``receive_bucket(meta, staging)``. Only transports that move bytes
without a handshake of their own take ``announce`` (``torch_dist``, ``nccl_uid``).

Transports (``weightsync.backend``; registry :data:`TRANSPORTS`, one module each):
  * ``torch_dist``: a torch.distributed group (gloo on CPU, NCCL on GPU), one broadcast per bucket;
  * ``nccl_uid``: an NCCL communicator from a unique id we mint: the sender end of vLLM's own ``nccl``
    weight-transfer engine (its receiving end is vLLM's; GPU only);
  * ``nixl``: receivers READ each bucket from the sender's registered memory over NIXL (UCX);
  * ``ipc``: one host: receivers copy each bucket out of memory the sender shares (POSIX shared memory,
    CUDA IPC).
``naive`` is not a transport: it is ``torch_dist`` sending one tensor per bucket, each waited for
(``layout=None``), the baseline the bucketed path is measured against. The publisher chooses a transport
for a set of servers with ``servers.choose_transport``.

To add a transport: write ``weightsync/<name>.py`` with a :class:`Transport` subclass decorated with
``@TRANSPORTS.register("<name>")`` implementing ``prepare``, ``connect``, ``start_bucket`` (and
``send_payload`` if it can take ``announce``), ``receive_weights``, ``fail`` and ``close``; add
``"<name>": "slipstream.weightsync.<name>:<Class>"`` to the lazy table below, the name to :data:`TransportName`
and the config's ``backend`` choices, and, if servers join it over HTTP, its ``joins`` (``group`` or
``stream``) and, where its receivers need typed buckets or leave without a barrier, ``type_buckets`` and
``leave_servers``: ``servers.ServerLink`` asks the transport, never its name.

Worked example (two processes; the structs pass between them as msgpack bytes)::

    # sender (trainer rank 0)                         # receiver (any process: a server, a vLLM worker)
    t = make_transport("torch_dist", cfg, is_sender=True)  r = make_transport("torch_dist", cfg, is_sender=False)
    mine = t.prepare()                                 raw = msgspec.msgpack.encode(r.prepare())
    info, (theirs,) = build_topology(mine, [msgspec.msgpack.decode(raw, type=Rendezvous)], "w")
    t.connect(info)                                    r.connect(theirs)
    await t.send_weights(model.named_parameters(), version=1)
                                                       version = await receive_version(r, model.load_weights)
    t.close()                                          r.close()
"""

from __future__ import annotations

import asyncio
import collections
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import ClassVar, Literal

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.utils.registry import Registry
from slipstream.weightsync.buckets import (
    BucketPacker,
    BufferPool,
    Layout,
    PackedBucket,
    StagingArea,
    per_tensor_buckets,
)
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import SourceFailed, TransferError
from slipstream.weightsync.types import BucketMeta, InitInfo, Rendezvous, VersionInfo

log = get_logger(__name__)

# An out-of-band announcement: hands one bucket's metadata to every receiver, returns once all landed it.
Announce = Callable[[BucketMeta], Awaitable[None]]
# What a receiver does with a whole version: load these tensors (views of staging memory: copy them).
Load = Callable[[list[tuple[str, torch.Tensor]], int], None]


class SendStats(msgspec.Struct, kw_only=True):
    """What one ``send_weights`` call moved, and how long its parts took (seconds)."""

    version: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pack_s: float = 0.0
    digest_s: float = 0.0  # of ``seconds``, digesting the tensors (``weightsync.verify``)


def resolve_device(cfg: WeightSyncConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


class WeightStream:
    """The tensors of one version as they arrive: ``async for name, tensor in stream``.

    ``version`` is known once the first bucket has arrived; ``nbytes`` counts payload bytes received. The
    iterator raises :class:`TransferError` when the transfer is cut short, and then nothing it yielded
    may be used. Yielded tensors live in the transport's receive memory: valid until the next version.
    """

    def __init__(self, source: Callable[[WeightStream], AsyncIterator[tuple[str, torch.Tensor]]]) -> None:
        self.version: int | None = None
        self.nbytes = 0
        self.tensors = 0
        self.started: float | None = None
        self.finished: float | None = None
        # The receiving end's staging area, where a source has one: entries that are not dense (and the
        # version's send-less fields) are staged there, not yielded (``StagingArea.parts``/``info``).
        self.staging: StagingArea | None = None
        # The source fills in version/nbytes as buckets arrive, so it is built around this stream.
        self._source = source(self)

    def __aiter__(self) -> WeightStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        try:
            item = await self._source.__anext__()
        except StopAsyncIteration:
            self.finished = time.perf_counter()
            raise
        self.tensors += 1
        return item

    async def collect(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, by name (raises TransferError if it does not complete)."""
        return {name: tensor async for name, tensor in self}


# The transports' names, one spelling everywhere: ``weightsync.backend`` (beside ``auto`` and ``naive``), the
# registry's keys, what an adapter's ``data_plane`` answers and a stream's name on the servers' routes.
TransportName = Literal["torch_dist", "nccl_uid", "nixl", "ipc"]
# How servers join a transport over their HTTP API (``servers.ServerLink``): a *group* each server's adapter
# joins with its init call, the buckets announced by its per-bucket calls; or a *stream* each server prepares
# and connects to (``/weightsync/<name>/prepare``, ``/connect``), whose versions travel in band.
JoinMode = Literal["group", "stream"]


class Transport(ABC):
    """One end of a weight transport: the sender (trainer rank 0) or one receiver (module docstring).

    Lifecycle: ``prepare`` → :func:`build_topology` (by whoever wires the ends) → ``connect`` → many
    ``send_weights`` / ``receive_weights`` → ``close``. Every wait is bounded by ``cfg.timeout_s``; any
    failure raises :class:`TransferError` and leaves the end needing a new ``prepare``/``connect`` round.

    A subclass implements the rendezvous, ``start_bucket`` (one bucket in band), ``receive_weights``,
    ``fail`` and ``close``; packing, double-buffering, statistics and the abort on a failed version are
    here. ``depth`` is how many buckets may be in flight (the sender holds that many buffers).
    """

    name: ClassVar[TransportName]
    depth: ClassVar[int] = 2
    joins: ClassVar[JoinMode] = "group"
    """How HTTP servers join it (:data:`JoinMode`)."""

    def __init__(self, cfg: WeightSyncConfig, *, is_sender: bool, device: str | torch.device | None = None):
        self.cfg = cfg
        self.is_sender = is_sender
        self.device = torch.device(device) if device is not None else resolve_device(cfg)
        self.bucket_bytes = cfg.bucket_mb << 20
        self.pool: BufferPool | None = None  # the sender's transfer buffers (a subclass makes them)
        # Receiving end: a version older than this is refused at its first bucket, before it is staged
        # (ends that call :meth:`check_version` there: ipc; elsewhere the caller checks the version it is told).
        self.min_version: int | None = None

    # -- rendezvous

    @abstractmethod
    def prepare(self) -> Rendezvous:
        """Allocate what the transport needs and return what peers must know to reach this end."""

    @abstractmethod
    def connect(self, info: InitInfo) -> None:
        """Join the ends described by ``info``; blocks until every member has joined (or times out)."""

    @abstractmethod
    def fail(self) -> None:
        """Tear down at once after a failure: peers waiting on this end fail instead of timing out."""

    @abstractmethod
    def close(self) -> None:
        """Leave and release transport resources (safe to call twice, and after a failure)."""

    def leave_servers(self) -> None:
        """Leave a link whose receivers are HTTP servers (``servers.ServerLink.close``): :meth:`close`, save
        that a transport whose receivers meet at a barrier on leaving does not wait for servers that never
        do (SGLang's destroy)."""
        self.close()

    def type_buckets(self, typed: bool) -> None:
        """Whether a receiver builds each out-of-band bucket as one typed tensor, so the sender must send the
        same datatype (a server kind's ``typed_buckets``: SGLang over NCCL); a transport that sends bytes
        either way ignores it."""
        return None

    # -- sending

    def layout(self) -> Layout:
        """How this transport cuts buckets when the caller names no layout."""
        return Layout.slipstream(self.bucket_bytes)

    @abstractmethod
    def start_bucket(self, bucket: PackedBucket) -> Awaitable[None]:
        """Put one bucket (metadata and payload) on its way before returning; the awaitable completes
        once every receiver holds it. Called from the event loop, in bucket order."""

    def send_payload(self, bucket: PackedBucket) -> None:
        """Move one bucket's payload whose metadata the caller announces itself (blocking; a thread)."""
        raise TransferError(f"`{self.name}` carries its own bucket metadata: send without `announce`")

    def _before_send(self, version: int) -> None:
        """Raise TransferError when this end cannot send now (not connected, broken)."""
        return None

    def _ready(self, bucket: PackedBucket) -> PackedBucket:
        """Runs in the packing thread once a bucket is packed, before it is announced (a GPU end
        synchronises its stream here, so no receiver reads bytes still being written)."""
        return bucket

    def _abort(self, version: int, err: BaseException) -> None:
        """Tell the receivers to drop ``version`` after the sender gave up on it (a worker thread)."""
        return None

    async def send_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        layout: Layout | None | str = "default",
        announce: Announce | None = None,
        info: VersionInfo | None = None,
    ) -> SendStats:
        """Send one version, streaming from ``named_tensors``; returns once every receiver holds it.

        ``layout``: ``"default"`` (:meth:`layout`), a :class:`Layout` (a server's own byte layout), or None
        for one tensor per bucket, each waited for (the ``naive`` baseline). ``announce``: out-of-band
        metadata (module docstring); one bucket is then in flight at a time, since each announcement
        returns only once its bucket landed. Raises :class:`TransferError` (:class:`SourceFailed` when
        ``named_tensors`` or packing failed, the cause chained); receivers then drop the version.
        Items may name their entry kind, ``(name, tensor, kind)``; ``info`` (the send-less fields) is
        stamped on every bucket (``send_less.py``).
        """
        if not self.is_sender:
            raise TransferError(f"`{self.name}`: send_weights on a receiving end")
        self._before_send(version)
        chosen = self.layout() if layout == "default" else layout
        if chosen is None:
            buckets: Iterator[PackedBucket] = per_tensor_buckets(
                named_tensors, version, self.device, info, verify=self.cfg.verify
            )
        else:
            assert isinstance(chosen, Layout) and self.pool is not None
            buckets = BucketPacker(
                named_tensors,
                version,
                chosen,
                self.pool,
                timeout_s=self.cfg.timeout_s,
                info=info,
                verify=self.cfg.verify,
            )
        if announce is None:
            start, depth = self.start_bucket, (1 if chosen is None else self.depth)
        else:
            start, depth = (lambda b: self._announced(b, announce)), 1
        stats, began = SendStats(version=version), time.perf_counter()
        try:
            await send_pipelined(map(self._ready, buckets), start, self._release, stats, depth=depth)
        except Exception as err:
            await asyncio.to_thread(self._abort, version, err)
            if isinstance(err, TransferError):
                raise
            raise SourceFailed(f"version {version}: packing failed ({err}); receivers dropped it") from err
        stats.seconds = time.perf_counter() - began
        stats.digest_s = buckets.digest_s if isinstance(buckets, BucketPacker) else 0.0
        return stats

    def _release(self, bucket: PackedBucket) -> None:
        if self.pool is not None:
            self.pool.release(bucket.slot)

    async def _announced(self, bucket: PackedBucket, announce: Announce) -> None:
        """One bucket with out-of-band metadata: the announcement (every receiver's blocking call) in
        flight while the payload moves. On any failure the transport is torn down, so receivers still
        blocked in their receive fail too, and the announcement is given up (after a short grace, when
        the payload failed first, for the receivers' answers to arrive)."""
        calls = asyncio.ensure_future(announce(bucket.meta))
        try:
            if bucket.meta.entries and bucket.meta.nbytes:
                await asyncio.to_thread(self.send_payload, bucket)
        except BaseException:
            await self._give_up(calls, grace_s=min(2.0, self.cfg.timeout_s))
            raise
        try:
            await calls
        except BaseException:
            await self._give_up(calls, grace_s=0)
            raise

    async def _give_up(self, calls: asyncio.Future, grace_s: float) -> None:
        try:
            self.fail()
        except Exception as err:
            log.debug("tearing the transport down: %s", err)
        if grace_s > 0:
            await asyncio.wait([calls], timeout=grace_s)
        calls.cancel()
        await asyncio.gather(calls, return_exceptions=True)

    # -- receiving

    @abstractmethod
    def receive_weights(self) -> WeightStream:
        """The next version's tensors, as they arrive, with in-band metadata."""

    def check_version(self, version: int) -> None:
        """Refuse ``version`` when it is older than ``min_version`` (TransferError)."""
        if self.min_version is not None and version < self.min_version:
            raise TransferError(f"version {version} is older than the serving version {self.min_version}")

    def receive_bucket(self, meta: BucketMeta, staging: StagingArea) -> list[tuple[str, torch.Tensor]]:
        """Land one bucket announced out of band into ``staging`` (blocking); the tensors it completed."""
        raise TransferError(f"`{self.name}` carries its own bucket metadata: use receive_weights()")


# ---------------------------------------------------------------------------------------------- registry

# Each transport module is imported when first chosen, and registers its class (setting ``cls.name``).
TRANSPORTS: Registry[type[Transport]] = Registry(
    "weight transport",
    "weightsync.backend",
    base=Transport,
    name_attr="name",
    lazy={
        "torch_dist": "slipstream.weightsync.torch_dist:TorchDistTransport",
        "nccl_uid": "slipstream.weightsync.nccl_uid:NcclUidTransport",
        "nixl": "slipstream.weightsync.nixl_engine:NixlTransport",
        "ipc": "slipstream.weightsync.ipc_engine:IpcTransport",
    },
)


def make_transport(
    name: str, cfg: WeightSyncConfig, *, is_sender: bool, device: str | torch.device | None = None
) -> Transport:
    """An end of the transport registered as ``name``; ValueError listing the known names otherwise."""
    return TRANSPORTS.get(name)(cfg, is_sender=is_sender, device=device)


def build_topology(
    sender: Rendezvous, receivers: list[Rendezvous], group_name: str = "slipstream_weights"
) -> tuple[InitInfo, list[InitInfo]]:
    """Ranks for one sender and ``receivers`` (in order): the sender's :class:`InitInfo` and one each.

    The sender is rank 0; each receiver's rank is its first of ``ranks`` consecutive ones. The sender's
    info lists every receiver as a peer, each receiver's the sender; all carry the sender's address.
    """
    wrong = sorted({r.backend for r in receivers} - {sender.backend})
    if wrong:
        raise ValueError(f"receivers of backend {wrong} cannot join a `{sender.backend}` sender")
    world = 1 + sum(r.ranks for r in receivers)

    def info(rank: int, peers: list[Rendezvous]) -> InitInfo:
        return InitInfo(
            backend=sender.backend,
            rank=rank,
            world_size=world,
            group_name=group_name,
            address=sender.address,
            port=sender.port,
            peers=peers,
        )

    rest, rank = [], 1
    for receiver in receivers:
        rest.append(info(rank, [sender]))
        rank += receiver.ranks
    return info(0, list(receivers)), rest


# ------------------------------------------------------------------------------------------- pipelining


async def send_pipelined(
    buckets: Iterator[PackedBucket],
    start: Callable[[PackedBucket], Awaitable[None]],
    release: Callable[[PackedBucket], None],
    stats: SendStats,
    depth: int = 1,
) -> None:
    """Send every bucket, packing the next one in a worker thread meanwhile.

    ``start(bucket)`` must put the bucket's transfer on its way before it returns (issue order is transfer
    order) and return an awaitable that completes with it; up to ``depth`` transfers are in flight at once
    (1 when each must be acknowledged before the next may start, as with a server's blocking HTTP call).
    ``release`` gives a bucket's buffer back once its transfer completed (or failed). Exceptions from
    packing (the caller's tensor iterator) and from transfers propagate, after every thread still running
    has been waited for, so no buffer is left held. The packing thread uses the caller's CUDA device (the
    tensor iterator may run collectives on it). ``stats`` counts buckets, tensors and bytes that arrived.
    """
    cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def pack_next() -> PackedBucket | None:
        if cuda is not None:
            torch.cuda.set_device(cuda)
        return next(buckets, None)

    async def pack() -> PackedBucket | None:
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(pack_next)
        finally:
            stats.pack_s += time.perf_counter() - t0

    in_flight: collections.deque[tuple[PackedBucket, asyncio.Future]] = collections.deque()

    async def finish_oldest() -> None:
        bucket, done = in_flight.popleft()
        try:
            await done
        finally:
            release(bucket)
        stats.buckets += 1
        stats.bytes += bucket.meta.nbytes
        stats.tensors += sum(1 for e in bucket.meta.entries if e.chunk_offset == 0)

    pending: asyncio.Task | None = asyncio.create_task(pack())
    try:
        while pending is not None:
            bucket = await pending
            pending = None
            if bucket is None:
                break
            in_flight.append((bucket, asyncio.ensure_future(start(bucket))))
            if not bucket.meta.last:
                pending = asyncio.create_task(pack())
            while len(in_flight) >= depth:
                await finish_oldest()
        while in_flight:
            await finish_oldest()
    finally:
        for bucket, done in in_flight:  # after a failure: wait for the rest, then give buffers back
            await asyncio.gather(done, return_exceptions=True)
            release(bucket)
        if pending is not None:
            try:
                leftover = await pending
            except Exception:  # the packing error is secondary to the one already propagating
                leftover = None
            if leftover is not None:
                release(leftover)


# ------------------------------------------------------------------------------------------- receiving


async def receive_version(transport: Transport, load: Load) -> int:
    """Receive one whole version over ``transport`` (in band) and ``load`` it at once; return the version.

    Nothing is loaded unless every bucket arrived: on :class:`TransferError` the staged tensors are
    dropped, the error is re-raised, and whatever ``load`` fed keeps what it had. ``load`` runs in a worker
    thread and gets views of the transport's staging memory: it must copy them in before returning. A
    server passes ``target.apply_weights``; a vLLM worker its model's ``load_weights`` (wrapped).
    """
    stream = transport.receive_weights()
    staged = await stream.collect()
    if stream.version is None:
        raise TransferError("the stream ended before any bucket arrived")
    if stream.staging is not None and stream.staging.parts:  # never a partial version loaded as whole
        raise TransferError(
            f"version {stream.version} carries delta or LoRA entries; receive it through a WeightReceiver, "
            "which rebuilds the full tensors (send_less.py)"
        )
    await asyncio.to_thread(load, list(staged.items()), stream.version)
    return stream.version
