"""The publisher's data planes: how rank 0 reaches a set of servers, opened together with their control calls.

A link is opened for a fixed set of servers (adding or losing one means a new link) and carries buckets:

* :class:`DistLink`: a torch.distributed group (``groups.open_group``; gloo on CPU, NCCL on GPU); each
  server joins through its adapter's ``init_group`` while rank 0 joins here, concurrently, since both
  block until everyone has arrived. SGLang and our embedded server.
* :class:`NcclUidLink`: an NCCL communicator built from a unique id we mint and post (vLLM 0.33's
  torch-free rendezvous); after ``ncclCommInitRank`` both sides run a one-element all-reduce (vLLM's
  warm-up handshake) before any broadcast. GPU only.
* :class:`NixlLink`: a NIXL sender engine; each embedded server prepares a receiving engine over HTTP and
  the whole version then travels in-band (``send_weights``).

Worked example (what the publisher does)::

    link = await DistLink.open(adapters, cfg, group_name="slipstream_weights")
    await asyncio.to_thread(link.send, bucket)   # while every adapter's update(bucket.meta) is in flight
    await link.close(adapters)
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import time
from collections.abc import Iterable, Sequence

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.weightsync.adapters import GroupSpec, ServerAdapter
from slipstream.weightsync.base import SendStats
from slipstream.weightsync.buckets import PackedBucket, parse_dtype
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.groups import DistGroup, backend_for_device, open_group, reserve_port
from slipstream.weightsync.types import Rendezvous

log = get_logger(__name__)


async def _offsets(adapters: Sequence[ServerAdapter]) -> tuple[list[int], int]:
    ranks = await asyncio.gather(*(a.ranks() for a in adapters))
    offsets, next_rank = [], 1
    for n in ranks:
        offsets.append(next_rank)
        next_rank += n
    return offsets, next_rank


async def _join_all(adapters: Sequence[ServerAdapter], specs: Sequence[GroupSpec], local) -> object:
    """Run every server's init call and the local join together; TransferError naming who failed."""
    calls = [asyncio.create_task(a.init_group(s)) for a, s in zip(adapters, specs, strict=True)]
    local_task = asyncio.create_task(asyncio.to_thread(local))
    results = await asyncio.gather(local_task, *calls, return_exceptions=True)
    errors = [
        f"{a.url}: {r}" for a, r in zip(adapters, results[1:], strict=True) if isinstance(r, BaseException)
    ]
    if isinstance(results[0], BaseException):
        errors.insert(0, f"trainer side: {results[0]}")
    if errors:
        if not isinstance(results[0], BaseException):
            _close_quietly(results[0])
        raise TransferError("could not build the weight group: " + "; ".join(errors))
    return results[0]


def _close_quietly(handle: object) -> None:
    try:
        handle.close(0)  # type: ignore[attr-defined]
    except Exception as err:  # a half-built group has little to release
        log.debug("closing a half-built group: %s", err)


class DistLink:
    """Rank 0 of a torch.distributed group with a fixed set of servers."""

    kind = "dist"

    def __init__(self, group: DistGroup, typed: bool, timeout_s: float, group_name: str) -> None:
        self.group = group
        self.typed = typed
        self.timeout_s = timeout_s
        self.group_name = group_name

    @classmethod
    async def open(cls, adapters: Sequence[ServerAdapter], cfg: WeightSyncConfig, device, group_name: str):
        offsets, world = await _offsets(adapters)
        backend = backend_for_device(device)
        sock = reserve_port(cfg.master_address, cfg.master_port)
        port = sock.getsockname()[1]
        specs = [
            GroupSpec(
                master_address=cfg.master_address,
                master_port=port,
                rank_offset=off,
                world_size=world,
                group_name=group_name,
                backend=backend,
            )
            for off in offsets
        ]

        def local() -> DistGroup:
            return open_group(
                master_address=cfg.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=group_name,
                backend=backend,
                timeout_s=cfg.timeout_s,
                listen_socket=sock,
            )

        group = await _join_all(adapters, specs, local)
        # SGLang's receiver builds its bucket as one typed tensor (single-dtype buckets); NCCL wants the
        # same datatype on both ends. Our receivers and gloo take plain bytes.
        typed = backend == "nccl" and any(a.kind == "sglang" for a in adapters)
        return cls(group, typed, cfg.timeout_s, group_name)  # type: ignore[arg-type]

    def send(self, bucket: PackedBucket) -> None:
        parts = [part for _, part in bucket.payloads()]
        if self.typed and bucket.meta.entries and len(parts) == 1:
            dtype = parse_dtype(bucket.meta.entries[0].dtype)
            if parts[0].numel() % dtype.itemsize == 0:
                parts = [parts[0].view(dtype)]
        works = [self.group.broadcast_async(part) for part in parts]
        for work in works:
            self.group.wait(work, self.timeout_s)

    def fail(self) -> None:
        """Tear the group down at once (peers blocked in a broadcast then fail instead of waiting)."""
        self.group.broken = True
        self.group.close(0)

    async def close(self, adapters: Iterable[ServerAdapter]) -> None:
        # No barrier: every broadcast was answered by the servers' update calls before a link is closed,
        # and SGLang's destroy never joins one (a barrier would stall, then abort the communicator).
        calls = [a.destroy_group(self.group_name) for a in adapters] if not self.group.broken else []
        results = await asyncio.gather(asyncio.to_thread(self.group.close, 0), *calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("leaving group %s: %s", self.group_name, r)


class NcclUidLink:
    """Rank 0 of an NCCL communicator built from a unique id (vLLM's rendezvous; GPU only).

    A peer that dies mid-broadcast leaves the NCCL kernel spinning: each broadcast runs on a stream of
    its own and is waited for up to ``timeout_s``; past that, or on any failure, the communicator is
    aborted (:func:`abort_comm`) so the GPU and the trainer's streams are free again.
    """

    kind = "nccl_uid"

    def __init__(self, comm, device: torch.device, group_name: str, timeout_s: float = 300.0) -> None:
        self.comm = comm
        self.device = device
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.stream = torch.cuda.Stream(device) if comm is not None else None

    @classmethod
    async def open(cls, adapters: Sequence[ServerAdapter], cfg: WeightSyncConfig, device, group_name: str):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise TransferError("vLLM weight sync runs over NCCL and needs a GPU on the trainer side")
        import torch.cuda.nccl as nccl

        offsets, world = await _offsets(adapters)
        uid = nccl.unique_id()
        uid_b64 = base64.b64encode(uid).decode()
        specs = [
            GroupSpec(
                master_address="",
                master_port=0,
                rank_offset=off,
                world_size=world,
                group_name=group_name,
                backend="nccl",
                nccl_unique_id_b64=uid_b64,
            )
            for off in offsets
        ]
        dev = torch.device(device)

        def local():
            torch.cuda.set_device(dev)
            comm = nccl.init_rank(world, uid, 0)
            probe = torch.zeros(1, device=dev)
            nccl.all_reduce([probe], comms=[comm])  # vLLM's warm-up handshake, before any broadcast
            torch.cuda.synchronize(dev)
            return _Comm(comm)

        handle = await _join_all(adapters, specs, local)
        return cls(handle.comm, dev, group_name, cfg.timeout_s)  # type: ignore[attr-defined]

    def send(self, bucket: PackedBucket) -> None:
        import torch.cuda.nccl as nccl

        if self.comm is None:
            raise TransferError(f"group `{self.group_name}`: the communicator was torn down")
        torch.cuda.set_device(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the bucket was packed there
        nccl.broadcast([bucket.data], root=0, streams=[self.stream], comms=[self.comm])
        done = torch.cuda.Event()
        done.record(self.stream)
        if not wait_done(done.query, self.timeout_s):
            self.fail()
            raise TransferError(
                f"group `{self.group_name}`: a broadcast did not complete within {self.timeout_s:g} s "
                "(a server died or stopped receiving); communicator aborted"
            )

    def fail(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            abort_comm(comm)

    async def close(self, adapters: Iterable[ServerAdapter]) -> None:
        await asyncio.gather(*(a.destroy_group(self.group_name) for a in adapters), return_exceptions=True)
        self.comm = None  # torch destroys a communicator when its last reference goes


class _Comm:
    def __init__(self, comm) -> None:
        self.comm = comm

    def close(self, _barrier: float = 0) -> None:
        if self.comm is not None:
            abort_comm(self.comm)  # a half-built link: its peers may never arrive
        self.comm = None


def wait_done(query, timeout_s: float, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Poll ``query()`` until it is true (True) or ``timeout_s`` has passed (False); backs off to 10 ms."""
    deadline, delay = clock() + timeout_s, 1e-4
    while not query():
        if clock() >= deadline:
            return False
        sleep(delay)
        delay = min(delay * 2, 0.01)
    return True


_ABORTED: list = []  # communicators aborted here: torch's destructor must never destroy them again


def abort_comm(comm) -> bool:
    """``ncclCommAbort`` on a ``torch.cuda.nccl`` communicator: its kernels stop and its resources go.

    torch exposes no abort, and its capsule's destructor calls ``ncclCommDestroy``, which would wait for
    the kernel a dead peer never completes. So the communicator is aborted through the NCCL library
    torch already loaded, and the capsule is kept alive for good so that destroy never runs on it.
    Returns False (the communicator is then only dropped) where the library or the symbol is missing.
    """
    _ABORTED.append(comm)
    try:
        lib = ctypes.CDLL("libnccl.so.2")
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        handle = get(comm, b"torch.cuda.nccl.Communicator")
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        return lib.ncclCommAbort(handle) == 0
    except (OSError, AttributeError, ValueError) as err:
        log.warning("could not abort an NCCL communicator (%s); it is left to the process", err)
        return False


class NixlLink:
    """A NIXL sender engine paired with the receiving engines of a set of embedded servers."""

    kind = "nixl"

    def __init__(self, engine, group_name: str) -> None:
        self.engine = engine
        self.group_name = group_name

    @classmethod
    async def open(cls, adapters: Sequence[ServerAdapter], cfg: WeightSyncConfig, device, group_name: str):
        from slipstream.weightsync.nixl_engine import NixlEngine

        engine = NixlEngine(cfg, is_sender=True, device=device)
        sender = await asyncio.to_thread(engine.prepare)
        raw = await asyncio.gather(*(a.nixl_prepare() for a in adapters))  # type: ignore[attr-defined]
        receivers = [msgspec.json.decode(r, type=Rendezvous) for r in raw]
        sender_info, _ = NixlEngine.build_topology(sender, receivers, group_name)
        sender_json = msgspec.to_builtins(sender)
        await asyncio.gather(*(a.nixl_connect(sender_json, group_name) for a in adapters))  # type: ignore[attr-defined]
        await asyncio.to_thread(engine.init_process_group, sender_info)
        return cls(engine, group_name)

    async def send_weights(self, named_tensors, version: int) -> SendStats:
        return await self.engine.send_weights(named_tensors, version)

    def fail(self) -> None:
        self.engine.finalize()

    async def close(self, adapters: Iterable[ServerAdapter]) -> None:
        await asyncio.to_thread(self.engine.finalize)


class IpcLink:
    """An ``ipc`` sender engine paired with the receiving engines of embedded servers on this host.

    While the link is open its servers' adapters carry ``transport = "ipc"``, so each version travels
    in-band (``/begin_weight_update {stream: "ipc"}``); closing or failing the link gives them back theirs.
    """

    kind = "ipc"

    def __init__(self, engine, adapters: Sequence[ServerAdapter], group_name: str) -> None:
        self.engine = engine
        self.group_name = group_name
        self._adapters = {id(a): (a, a.transport) for a in adapters}
        for adapter in adapters:
            adapter.transport = "ipc"  # type: ignore[misc]

    @classmethod
    async def open(cls, adapters: Sequence[ServerAdapter], cfg: WeightSyncConfig, device, group_name: str):
        from slipstream.weightsync.ipc_engine import IpcEngine

        engine = IpcEngine(cfg, is_sender=True, device=device)
        try:
            sender = await asyncio.to_thread(engine.prepare)
            receivers = await _ipc_receivers(adapters)
            sender_info, _ = IpcEngine.build_topology(sender, receivers, group_name)
            body = {"sender": msgspec.to_builtins(sender), "group_name": group_name}
            calls = [
                asyncio.create_task(a.call("POST", "/weightsync/ipc/connect", json=body)) for a in adapters
            ]
            local = asyncio.create_task(asyncio.to_thread(engine.init_process_group, sender_info))
            done, _ = await asyncio.wait([local, *calls], return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done):
                engine.finalize()  # wakes the sender's accept, so nobody waits for the timeout
            results = await asyncio.gather(local, *calls, return_exceptions=True)
            errors = [
                f"{a.url}: {r}"
                for a, r in zip(adapters, results[1:], strict=True)
                if isinstance(r, BaseException)
            ]
            if isinstance(results[0], BaseException):
                errors.insert(0, f"trainer side: {results[0]}")
            if errors:
                raise TransferError("could not build the ipc link: " + "; ".join(errors))
        except BaseException:
            engine.finalize()
            raise
        return cls(engine, adapters, group_name)

    @staticmethod
    async def colocated(adapters: Sequence[ServerAdapter], device) -> bool:
        """Whether every server runs on this host and, for a GPU ``device``, on the same physical GPU."""
        from slipstream.weightsync.ipc_engine import colocated, device_identity, host_identity

        me = Rendezvous(backend="ipc", host=host_identity(), device=device_identity(torch.device(device)))
        try:
            receivers = await _ipc_receivers(adapters)
        except (TransferError, msgspec.ValidationError) as err:
            log.info("weightsync.backend auto: no ipc (%s)", err)
            return False
        return all(colocated(me, r) for r in receivers)

    async def send_weights(self, named_tensors, version: int) -> SendStats:
        return await self.engine.send_weights(named_tensors, version)

    def fail(self) -> None:
        self.engine.finalize()
        self._give_back()

    async def close(self, adapters: Iterable[ServerAdapter]) -> None:
        await asyncio.to_thread(self.engine.finalize)
        self._give_back()

    def _give_back(self) -> None:
        for adapter, transport in self._adapters.values():
            adapter.transport = transport  # type: ignore[misc]


async def _ipc_receivers(adapters: Sequence[ServerAdapter]) -> list[Rendezvous]:
    bodies = await asyncio.gather(*(a.call("POST", "/weightsync/ipc/prepare") for a in adapters))
    return [msgspec.convert(body, Rendezvous) for body in bodies]


LINKS = {"dist": DistLink, "nccl_uid": NcclUidLink, "nixl": NixlLink, "ipc": IpcLink}


async def choose_link(cfg: WeightSyncConfig, adapter_cls: type[ServerAdapter], adapters, device) -> type:
    """The link for a push to ``adapters``: ``weightsync.backend``, where ``auto`` picks ``ipc`` for embedded
    servers that all share this host (and this GPU, for a GPU sender) and their own transport otherwise."""
    if cfg.backend in ("nixl", "ipc"):
        return LINKS[cfg.backend]
    if cfg.backend == "auto" and adapter_cls.kind == "embedded" and adapters:
        if await IpcLink.colocated(adapters, device):
            return IpcLink
    return LINKS[adapter_cls.transport]
