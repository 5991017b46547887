"""Clients of the TransferQueue: :class:`QueueClient` (blocking) and :class:`AsyncQueueClient` (asyncio).

Both speak the protocol written once in :mod:`slipstream.queue.ops` over long-lived DEALER sockets (one to
the controller, one per storage unit, opened on first use), with many requests in flight matched by
``req_id``. A same-host client maps the server's shared-memory arenas at its first call (``HELLO``); its puts
then copy each group once into an arena region and its leases get views of those pages (no bytes on any
socket); a group built with ``alloc_group`` already lies there, and its put copies nothing. Same-host clients
also send their control requests over a plain Unix socket (:mod:`slipstream.queue.direct`). Across hosts,
or with ``shared_memory=False``, payloads travel as zero-copy socket frames. A server bound beyond loopback
requires its token (:mod:`slipstream.queue.auth`): in the address it gives out (``tcp://TOKEN@host:port``), as
``token=``, or in ``$SLIPSTREAM_QUEUE_TOKEN``.

Lifecycle of a batch on the consumer side::

    lease = client.lease(8, timeout_s=30)         # blocks until 8 groups are ready (None on timeout)
    batch = collate(lease.groups)                  # copies out of the leased buffers
    ... train on batch ...
    client.ack(lease, dropped=[ids too stale])    # consumed for good; or client.nack(lease) to give back

Invariants users can rely on:
  * ``put`` stores a group at most once: a group id or uid seen before (ready, leased or acked) returns
    False and stores nothing, so a producer may retry a put whose reply it never saw;
  * a lease not acked within the server's ``lease_timeout_s`` goes back to the front of the ready set (a
    consumer that dies loses nothing); closing a client nacks the leases it still holds;
  * a client reconnects by itself when its connection broke (the server restarted on the same address): an
    operation none of which reached the server is run again at once on a fresh connection; one that may have
    reached it raises ``QueueUnreachable`` and the next call reconnects;
  * **buffer lifetime**: a leased group's tensors may be views of the server's shared memory or of received
    frames. Views of shared memory are valid until the lease is acked, nacked or expired; copy what you
    keep (``collate`` copies). Treat them as read-only.

Neither client is thread-safe across threads at once (the sync one serialises its calls with a lock); use
one client per thread or per event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import zmq

from slipstream.queue import ops
from slipstream.queue import protocol as P
from slipstream.queue.base import Lease, QueueConsumer, QueueProducer
from slipstream.queue.clientbase import ClientBase
from slipstream.queue.codec import send_frames
from slipstream.queue.errors import QueueUnreachable
from slipstream.queue.ops import CONTROLLER, Call, QueueError, QueueFull, Session
from slipstream.queue.protocol import QueueStats
from slipstream.queue.types import GroupMeta, TrajectoryGroup
from slipstream.utils.logging import get_logger

__all__ = ["AsyncQueueClient", "Lease", "QueueClient", "QueueError", "QueueFull", "QueueStats"]

log = get_logger(__name__)

_SNAPSHOT_WAIT_S = 600.0  # a snapshot writes every unconsumed byte to disk


def _lease_id(lease: Lease | str) -> str:
    return lease.lease_id if isinstance(lease, Lease) else lease


class QueueClient(ClientBase, QueueConsumer):
    """Blocking client (the trainer's): a :class:`~slipstream.queue.base.QueueConsumer`, and it puts too.

    ``owner``: the secret the server binds this client's leases and credits to (random by default). Give a
    consumer that takes over after a crash the secret of the one that died, and it can nack their leases.

    Worked example::

        client = QueueClient(handle.address)
        client.put(TrajectoryGroup.from_trajectories(trajs))     # True (False: seen before)
        lease = client.lease(1, timeout_s=10)
        client.ack(lease)
        client.stats().partitions["train"].acked_total            # 1
        client.close()
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        shared_memory: bool = True,
        ipc: bool = True,
        token: str | None = None,
        owner: bytes | None = None,
    ) -> None:
        super().__init__(address, timeout_s, shared_memory, ipc, token, owner)
        self._ctx = zmq.Context()
        self._sockets: dict[int, zmq.Socket] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------------------- API
    def put(
        self, group: TrajectoryGroup, *, partition: str = "train", timeout_s: float | None = None
    ) -> bool:
        """Store a whole group; False (nothing stored) when its group id or any uid was already seen.
        Waits on back-pressure up to ``timeout_s`` (default: the server's ``put_timeout_s``), then raises
        QueueFull."""
        return self._run(lambda s: ops.put(s, group, partition, self._put_wait(timeout_s)))

    def alloc_group(
        self, meta: GroupMeta, extra: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None
    ) -> TrajectoryGroup:
        """A group to fill in place: its tensors (the standard columns, sized from ``meta``, plus ``extra``
        ones given as ``name: (shape, dtype)``, response-aligned) are views of the server's shared memory,
        so ``put(group)`` copies no payload byte. Their contents start undefined: fill every one.

        Put it within a few seconds (at least ``ops.ALLOC_WINDOW_S``; the exact bound is
        ``group.placement.usable_until``, in ``time.monotonic()`` seconds): after that the server may hand
        the region to another producer, so the put fails and the group must be allocated and filled again.
        After the put its tensors belong to the queue: do not write them. Without shared memory (another
        host, or no arena room right now) the tensors are ordinary ones and ``put`` copies as usual.

        Worked example::

            group = client.alloc_group(meta, {"pixels": ((n_response_tokens, 3 * 224 * 224), torch.uint8)})
            group.tensors["response_ids"].copy_(ids) ... group.tensors["pixels"].copy_(frames)
            client.put(group)
        """
        return self._run(lambda s: ops.alloc_group(s, meta, extra or {}))

    def lease(
        self,
        n_groups: int,
        *,
        partition: str = "train",
        timeout_s: float | None = None,
        min_groups: int | None = None,
        consumer_version: int | None = None,
    ) -> Lease | None:
        """Up to ``n_groups`` groups, FIFO, once ``min_groups`` (default ``n_groups``) are ready; None on
        timeout. ``consumer_version`` (the trainer's weight version) feeds the staleness histogram."""
        lease = self._run(
            lambda s: ops.lease(s, n_groups, partition, self._wait(timeout_s), min_groups, consumer_version)
        )
        if lease is not None:
            self._held.add(lease.lease_id)
        return lease

    def ack(self, lease: Lease | str, *, dropped: Sequence[str] = ()) -> None:
        """Consume the lease's groups for good; ``dropped`` ids were not trained (kept for pop_dropped)."""
        self._run(lambda s: ops.ack(_lease_id(lease), dropped))
        self._held.discard(_lease_id(lease))

    def nack(self, lease: Lease | str) -> None:
        """Give the lease's groups back to the front of the ready set now."""
        self._run(lambda s: ops.nack(_lease_id(lease)))
        self._held.discard(_lease_id(lease))

    def pop_dropped(self, max_groups: int = 1024) -> list[GroupMeta]:
        return self._run(lambda s: ops.pop_dropped(max_groups))

    def snapshot(self, name: str) -> dict:
        """Save everything unconsumed or leased, the consumed uids and the dropped list as snapshot ``name``:
        a file inside the server's ``queue.snapshot_dir`` (``"step_00000010/queue"``), never a path."""
        return self._run(lambda s: ops.path_request(P.MsgType.SNAPSHOT, str(name), _SNAPSHOT_WAIT_S))

    def restore(self, name: str) -> dict:
        """Bring snapshot ``name`` (in the server's ``snapshot_dir``) back into the queue: a rollback to a
        snapshot this server took, else a merge (``slipstream.queue.recovery``)."""
        return self._run(lambda s: ops.path_request(P.MsgType.RESTORE, str(name), _SNAPSHOT_WAIT_S))

    def stats(self) -> QueueStats:
        return self._run(lambda s: ops.stats())

    def ping(self) -> None:
        self._run(lambda s: ops_ping())

    def close(self) -> None:
        """Nack the leases still held (best effort), then close the sockets and unmap the arenas."""
        with self._lock:
            if self._closed:
                return
            self.timeout_s = min(self.timeout_s, 5.0)
            for op in self._closing_ops():
                try:
                    self._drive(op)
                except QueueError as err:
                    log.warning("could not hand back what this client held on close: %s", err)
            self._closed = True
            for sock in self._sockets.values():
                sock.close(linger=0)
            if self._session is not None:
                self._session.close()
            self._ctx.term()

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- driver
    def _run(self, make_op: Callable[[Session], ops.Op]) -> Any:
        """Run an operation; when the connection broke before any of it got through (the server restarted),
        reconnect and run it once more."""
        with self._lock:
            if self._closed:
                raise QueueError("the queue client is closed")
            for attempt in range(2):
                self._connect()
                try:
                    return self._drive(make_op(self._session))
                except QueueUnreachable as err:
                    self._reset()  # the next call says HELLO on fresh sockets
                    if attempt or err.sent:
                        raise
                    log.info("reconnecting to the queue server at %s: %s", self.address, err)

    def _connect(self) -> None:
        if self._session is not None:
            return
        self._adopt(self._drive(ops.hello(self._use_shm, self._use_ipc)))
        if self._session.direct:  # reconnect over the direct channel from now on
            self._sockets.pop(CONTROLLER).close(linger=0)

    def _reset(self) -> None:
        """Drop the connection: sockets, arena mappings, credits (held leases stay this client's)."""
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        if self._session is not None:
            self._session.close()
            self._session = None

    def _drive(self, op: ops.Op) -> Any:
        value: Any = None
        error: QueueError | None = None
        progressed = False
        while True:
            try:
                step = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                return stop.value
            calls = step if isinstance(step, list) else [step]
            try:
                replies = self._exchange(calls)
                value, error = (replies if isinstance(step, list) else replies[0]), None
                progressed = True
            except QueueError as err:
                value, error = None, self._progressed(err, progressed)

    def _socket(self, target: int) -> Any:
        sock = self._sockets.get(target)
        if sock is None:
            sock = self._sockets[target] = self._new_socket(target)
        return sock

    def _exchange(self, calls: list[Call]) -> list[Any]:
        sent = []
        for call in calls:
            self._stamp(call.header)
            try:
                frames = self._codec.encode(call.msg_type, call.header, call.buffers)
                send_frames(self._socket(call.target), frames)
            except QueueUnreachable as err:
                err.sent = err.sent or bool(sent)
                for done in sent:
                    self._abandon(done.header.req_id, done.msg_type)
                raise
            sent.append(call)
        wait_s = self._deadline(calls)
        deadline = time.monotonic() + wait_s
        try:
            return [self._await(call, deadline, wait_s) for call in sent]
        except BaseException:
            for call in sent:
                self._abandon(call.header.req_id, call.msg_type)
            raise

    def _await(self, call: Call, deadline: float, wait_s: float) -> Any:
        sock = self._sockets[call.target]
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000):
                raise self._timeout_error(wait_s)
            frames = sock.recv_multipart(copy=False)
            if len(frames) > 1 and self._codec.req_id(frames[1]) == call.header.req_id:
                return self._reply(frames, call)
            stale = self._stale_lease(frames)
            if stale:
                self._send_nack(stale)

    def _send_nack(self, lease_id: str) -> None:
        req = P.NackRequest(next(self._ids), lease_id, owner=self._owner)
        self._abandon(req.req_id, P.MsgType.NACK)
        self._socket(CONTROLLER).send_multipart(self._codec.encode(P.MsgType.NACK, req))


def ops_ping() -> ops.Op:
    yield Call(CONTROLLER, P.MsgType.PING, P.PingRequest(0))


class AsyncQueueClient(ClientBase, QueueProducer):
    """The asyncio twin of :class:`QueueClient` (same methods, ``async``), for the rollouter's event loop: a
    :class:`~slipstream.queue.base.QueueProducer`.

    Any number of coroutines may call it at once: requests share the sockets, and each reply is routed to
    its waiting coroutine by ``req_id``. Cancelling a ``lease`` call gives back a lease that the server grants
    after the cancellation. Bind it to one event loop (the one of its first call).

    Why not ``zmq.asyncio``: its per-message futures and reader tasks cost about half again the CPU of a
    blocking round trip. Here the sockets are plain ZeroMQ sockets: sends never block (no high-water mark),
    and the loop's ``add_reader`` on each socket's ``ZMQ_FD`` drains replies straight into the waiting
    futures. That FD is edge-triggered, so every send is followed by one more drain.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        shared_memory: bool = True,
        ipc: bool = True,
        token: str | None = None,
        owner: bytes | None = None,
    ) -> None:
        super().__init__(address, timeout_s, shared_memory, ipc, token, owner)
        self._ctx = zmq.Context()
        self._sockets: dict[int, zmq.Socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[int, tuple[asyncio.Future, Call]] = {}
        self._hello: asyncio.Future | None = None

    async def put(
        self, group: TrajectoryGroup, *, partition: str = "train", timeout_s: float | None = None
    ) -> bool:
        return await self._run(lambda s: ops.put(s, group, partition, self._put_wait(timeout_s)))

    async def alloc_group(
        self, meta: GroupMeta, extra: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None
    ) -> TrajectoryGroup:
        return await self._run(lambda s: ops.alloc_group(s, meta, extra or {}))

    async def lease(
        self,
        n_groups: int,
        *,
        partition: str = "train",
        timeout_s: float | None = None,
        min_groups: int | None = None,
        consumer_version: int | None = None,
    ) -> Lease | None:
        lease = await self._run(
            lambda s: ops.lease(s, n_groups, partition, self._wait(timeout_s), min_groups, consumer_version)
        )
        if lease is not None:
            self._held.add(lease.lease_id)
        return lease

    async def ack(self, lease: Lease | str, *, dropped: Sequence[str] = ()) -> None:
        await self._run(lambda s: ops.ack(_lease_id(lease), dropped))
        self._held.discard(_lease_id(lease))

    async def nack(self, lease: Lease | str) -> None:
        await self._run(lambda s: ops.nack(_lease_id(lease)))
        self._held.discard(_lease_id(lease))

    async def pop_dropped(self, max_groups: int = 1024) -> list[GroupMeta]:
        return await self._run(lambda s: ops.pop_dropped(max_groups))

    async def snapshot(self, name: str) -> dict:
        return await self._run(lambda s: ops.path_request(P.MsgType.SNAPSHOT, str(name), _SNAPSHOT_WAIT_S))

    async def restore(self, name: str) -> dict:
        return await self._run(lambda s: ops.path_request(P.MsgType.RESTORE, str(name), _SNAPSHOT_WAIT_S))

    async def stats(self) -> QueueStats:
        return await self._run(lambda s: ops.stats())

    async def ping(self) -> None:
        await self._run(lambda s: ops_ping())

    async def close(self) -> None:
        if self._closed:
            return
        self.timeout_s = min(self.timeout_s, 5.0)
        for op in self._closing_ops():
            try:
                await self._drive(op)
            except QueueError as err:
                log.warning("could not hand back what this client held on close: %s", err)
        self._closed = True
        for sock in self._sockets.values():
            if self._loop is not None:
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
            sock.close(linger=0)
        if self._session is not None:
            self._session.close()
        self._ctx.term()

    async def __aenter__(self) -> AsyncQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------- driver
    async def _run(self, make_op: Callable[[Session], ops.Op]) -> Any:
        """Run an operation; when the connection broke before any of it got through (the server restarted),
        reconnect and run it once more."""
        for attempt in range(2):
            if self._closed:
                raise QueueError("the queue client is closed")
            session = self._session
            try:
                session = await self._connect()
                return await self._drive(make_op(session))
            except QueueUnreachable as err:
                self._reset(session)  # the next call says HELLO on fresh sockets
                if attempt or err.sent:
                    raise
                log.info("reconnecting to the queue server at %s: %s", self.address, err)

    async def _connect(self) -> Session:
        if self._session is None:
            if self._hello is None:  # concurrent first calls share one HELLO
                self._hello = asyncio.ensure_future(self._drive(ops.hello(self._use_shm, self._use_ipc)))
            hello = self._hello
            try:
                session = await asyncio.shield(hello)
            except BaseException:
                if self._hello is hello:
                    self._hello = None
                raise
            if self._session is None:
                self._adopt(session)
                if session.direct:  # reconnect over the direct channel from now on
                    sock = self._sockets.pop(CONTROLLER)
                    self._loop.remove_reader(sock.getsockopt(zmq.FD))
                    sock.close(linger=0)
        return self._session

    def _reset(self, session: Session | None) -> None:
        """Drop the connection ``session`` ran on, unless another call already did: sockets, arena mappings,
        credits (held leases stay this client's); what still waits on them fails."""
        if session is not self._session:
            return
        for sock in self._sockets.values():
            if self._loop is not None:
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
            sock.close(linger=0)
        self._sockets.clear()
        broken = QueueUnreachable("the connection to the queue server was reset", sent=True)
        for future, _call in list(self._waiting.values()):
            if not future.done():
                future.set_exception(broken)
        if session is not None:
            session.close()
        self._session = self._hello = None

    async def _drive(self, op: ops.Op) -> Any:
        value: Any = None
        error: QueueError | None = None
        progressed = False
        while True:
            try:
                step = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                return stop.value
            calls = step if isinstance(step, list) else [step]
            try:
                replies = await self._exchange(calls)
                value, error = (replies if isinstance(step, list) else replies[0]), None
                progressed = True
            except QueueError as err:
                value, error = None, self._progressed(err, progressed)

    def _socket(self, target: int) -> Any:
        sock = self._sockets.get(target)
        if sock is None:
            sock = self._sockets[target] = self._new_socket(target)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain, sock)
        return sock

    def _send(self, target: int, frames: list[Any]) -> None:
        sock = self._socket(target)
        send_frames(sock, frames)
        self._loop.call_soon(self._drain, sock)  # the send may have consumed the FD's edge

    async def _exchange(self, calls: list[Call]) -> list[Any]:
        loop = asyncio.get_running_loop()
        futures = []
        wait_s = self._deadline(calls)
        try:
            for call in calls:
                self._stamp(call.header)
                future = loop.create_future()
                self._waiting[call.header.req_id] = (future, call)
                futures.append(future)
                try:
                    self._send(call.target, self._codec.encode(call.msg_type, call.header, call.buffers))
                except QueueUnreachable as err:
                    err.sent = err.sent or len(futures) > 1
                    raise
            async with asyncio.timeout(wait_s):
                return [await f for f in futures]
        except TimeoutError:
            raise self._timeout_error(wait_s) from None
        finally:
            for call, future in zip(calls, futures, strict=False):
                self._waiting.pop(call.header.req_id, None)
                if not future.done():
                    future.cancel()
                    self._abandon(call.header.req_id, call.msg_type)

    def _drain(self, sock: zmq.Socket) -> None:
        """Route every reply waiting on ``sock`` (runs as the loop's reader callback)."""
        if self._closed:
            return
        try:
            self._route(sock)
        except QueueError as err:  # the direct channel broke: fail what waits on it, stop watching it
            self._loop.remove_reader(sock.getsockopt(zmq.FD))
            for future, call in list(self._waiting.values()):
                if call.target == CONTROLLER and not future.done():
                    future.set_exception(err)

    def _route(self, sock: Any) -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            entry = self._waiting.get(self._codec.req_id(frames[1])) if len(frames) > 1 else None
            if entry is None:
                stale = self._stale_lease(frames)
                if stale:
                    req = P.NackRequest(next(self._ids), stale, owner=self._owner)
                    self._abandon(req.req_id, P.MsgType.NACK)
                    self._send(CONTROLLER, self._codec.encode(P.MsgType.NACK, req))
                continue
            future, call = entry
            if future.done():
                continue
            try:
                future.set_result(self._reply(frames, call))
            except Exception as err:  # noqa: BLE001 - delivered to the waiting coroutine
                future.set_exception(err)
