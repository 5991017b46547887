"""The checkpoint engine: one interface for every transport that moves a weight version to receivers.

One sender (trainer rank 0) pushes each version to K receivers. An engine is used in four steps, the same
for every transport (verl's CheckpointEngine shape, design.md §3):

1. ``prepare()`` on every side returns a :class:`Rendezvous` (a msgspec Struct: it travels as bytes over
   our own HTTP or pipes, never pickled);
2. the controller calls the class method ``build_topology(sender, receivers)``, which gives each side its
   :class:`InitInfo` (rank, world size, peers);
3. ``init_process_group(info)`` on every side, concurrently (it returns once all have joined);
4. per version: the sender ``await send_weights(named_tensors, version)`` while every receiver iterates
   ``receive_weights()``; then ``finalize()`` when done (or after any :class:`TransferError`, after which
   the group must be rebuilt from step 1).

Receivers stage: ``receive_weights()`` yields tensors that land in receive memory the engine keeps, and
:func:`receive_into` hands the whole version to a :class:`WeightTarget` only once it is complete, so a
transfer cut short changes nothing that serves.

Backends (``weightsync.backend``), one module each, looked up in :data:`ENGINES`:
  * ``torch_dist``: a torch.distributed group (gloo on CPU, NCCL on GPU), bucketed and double-buffered;
  * ``naive``: the same group, one tensor at a time: the baseline the bucketed path is measured against;
  * ``nixl``: NIXL (UCX) reads from the sender's registered buffers, DRAM or GPU memory.
  * ``ipc``: one host: receivers copy out of buffers the sender shares (POSIX shared memory, CUDA IPC).
To add one: write ``weightsync/<name>.py`` with a :class:`CheckpointEngine` subclass decorated with
``@ENGINES.register("<name>")``, add ``"<name>": "slipstream.weightsync.<name>:<Class>"`` to the lazy table of
:data:`ENGINES` and the name to the config's ``backend`` choices.

Worked example (two processes; the rendezvous structs are passed between them as msgpack bytes)::

    # sender                                         # receiver
    eng = make_engine(cfg, is_sender=True)           eng = make_engine(cfg, is_sender=False)
    s = eng.prepare()                                r = eng.prepare()
    send_info, (recv_info,) = TorchDistEngine.build_topology(s, [r])
    eng.init_process_group(send_info)                eng.init_process_group(recv_info)
    await eng.send_weights(model.named_parameters(), version=1)
                                                     version = await receive_into(eng, target)
"""

from __future__ import annotations

import asyncio
import collections
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import ClassVar

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.utils.registry import Registry
from slipstream.weightsync.buckets import PackedBucket
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import InitInfo, Rendezvous, WeightTarget

log = get_logger(__name__)


class SendStats(msgspec.Struct, kw_only=True):
    """What one ``send_weights`` call moved, and how long its parts took (seconds)."""

    version: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pack_s: float = 0.0


def resolve_device(cfg: WeightSyncConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


class WeightStream:
    """The tensors of one version as they arrive: ``async for name, tensor in stream``.

    ``version`` is known once the first bucket has arrived; ``nbytes`` counts payload bytes received. The
    iterator raises :class:`TransferError` when the transfer is cut short, and then nothing it yielded
    may be used. Yielded tensors live in the engine's receive memory: valid until the next version.
    """

    def __init__(self, source: Callable[[WeightStream], AsyncIterator[tuple[str, torch.Tensor]]]) -> None:
        self.version: int | None = None
        self.nbytes = 0
        self.tensors = 0
        self.started: float | None = None
        self.finished: float | None = None
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


class CheckpointEngine(ABC):
    """Moves versions of named tensors from one sender to ``world_size - 1`` receivers.

    Lifecycle: ``prepare`` → ``build_topology`` (class method, run by the controller) →
    ``init_process_group`` → many ``send_weights`` / ``receive_weights`` → ``finalize``. Every wait is
    bounded by ``cfg.timeout_s``; any failure raises :class:`TransferError` and leaves the engine needing
    a new ``prepare``/``init_process_group`` round.
    """

    name: ClassVar[str]

    def __init__(self, cfg: WeightSyncConfig, *, is_sender: bool, device: str | torch.device | None = None):
        self.cfg = cfg
        self.is_sender = is_sender
        self.device = torch.device(device) if device is not None else resolve_device(cfg)
        self.bucket_bytes = cfg.bucket_mb << 20

    @abstractmethod
    def prepare(self) -> Rendezvous:
        """Allocate what the transport needs and return what peers must know to reach this side."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, sender: Rendezvous, receivers: list[Rendezvous], group_name: str = "slipstream_weights"
    ) -> tuple[InitInfo, list[InitInfo]]:
        """Assign ranks: the sender's init info and one per receiver, in ``receivers`` order."""

    @abstractmethod
    def init_process_group(self, info: InitInfo) -> None:
        """Join the group described by ``info``; blocks until every member has joined (or times out)."""

    @abstractmethod
    async def send_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SendStats:
        """Send one version, streaming from ``named_tensors``; returns once every payload has left."""

    @abstractmethod
    def receive_weights(self) -> WeightStream:
        """The next version's tensors, as they arrive."""

    @abstractmethod
    def finalize(self) -> None:
        """Leave the group and release transport resources (safe to call twice, and after a failure)."""


# ---------------------------------------------------------------------------------------------- registry

# Each backend module is imported when first chosen, and registers its class (setting ``cls.name``).
ENGINES: Registry[type[CheckpointEngine]] = Registry(
    "weight-sync backend",
    "weightsync.backend",
    base=CheckpointEngine,
    name_attr="name",
    lazy={
        "torch_dist": "slipstream.weightsync.torch_dist:TorchDistEngine",
        "naive": "slipstream.weightsync.naive:NaiveEngine",
        "nixl": "slipstream.weightsync.nixl_engine:NixlEngine",
        "ipc": "slipstream.weightsync.ipc_engine:IpcEngine",
    },
)


def get_engine_class(name: str) -> type[CheckpointEngine]:
    """The engine class registered as ``name``; ValueError listing the known names otherwise."""
    return ENGINES.get(name)


def make_engine(
    cfg: WeightSyncConfig, *, is_sender: bool, device: str | torch.device | None = None
) -> CheckpointEngine:
    return get_engine_class(cfg.backend)(cfg, is_sender=is_sender, device=device)


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
    tensor iterator may run collectives on it).
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


async def receive_into(engine: CheckpointEngine, target: WeightTarget) -> int:
    """Receive one whole version and apply it to ``target`` at once; return the version.

    Nothing reaches the target unless every bucket arrived: on :class:`TransferError` the staged tensors
    are dropped, the error is re-raised, and the target keeps serving what it had.
    """
    stream = engine.receive_weights()
    staged = await stream.collect()
    if stream.version is None:
        raise TransferError("the stream ended before any bucket arrived")
    await asyncio.to_thread(target.apply_weights, list(staged.items()), stream.version)
    return stream.version
