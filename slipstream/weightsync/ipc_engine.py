"""``ipc``: weight pushes between processes on one host, through memory both of them map.

Why it exists: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a trainer and an inference
server sharing a GPU cannot use ``torch_dist``; and between processes on one host a network transport
(gloo over loopback, NIXL over UCX's TCP lane) runs far below the speed of a memory copy. Here the sender
packs each bucket into one of two buffers it shares with every receiver and announces it; each receiver
copies the bucket out of the mapped buffer straight into its staging memory and acknowledges; the sender
reuses a buffer once every receiver acknowledged it, packing bucket *i+1* while receivers copy bucket *i*.
Buckets, versions, staging and aborts are those of the other transports (the ``slipstream`` layout: mixed
dtypes, tensors larger than a bucket in chunks; a version reaches the target whole or not at all).

Two memory kinds behind one protocol (``weightsync/ipc_memory.py``: :class:`HostMemory`, :class:`CudaMemory`),
chosen by the sender's device:
  * host memory: POSIX shared memory through torch's file-descriptor sharing (``UntypedStorage.
    _new_using_fd_cpu`` / ``_share_fd_cpu_`` / ``_new_shared_fd_cpu``). torch creates each segment in
    /dev/shm under a random name and unlinks the name at once, so a segment lives only as open
    descriptors and mappings: the kernel frees it when the last process holding it lets go or dies, and no
    name is left behind whoever is killed. Descriptors reach receivers as SCM_RIGHTS data on the control
    socket (never a pickle).
  * GPU memory: each buffer is shared by CUDA IPC handle: the fields of ``UntypedStorage._share_cuda_()``
    travel as a msgspec struct and the receiver opens them with ``UntypedStorage._new_shared_cuda``, the
    calls ``torch.multiprocessing`` makes, without its pickling. The sender synchronises its stream after
    packing a bucket and before announcing it; the receiver synchronises after copying it out and before
    acknowledging: nobody reads bytes still being written, nor overwrites bytes still being read.

Control: one Unix stream socket per receiver, in a directory only its owner can enter, carrying
length-prefixed msgpack :class:`~slipstream.weightsync.types.IpcMessage`; a receiver proves itself with
the secret of the sender's rendezvous. A reader thread per connection turns the socket into an inbox, so a
peer that dies is seen at once (end of stream), not after a timeout: the sender fails the push and tells
the other receivers to drop the version; a receiver drops the version (its staging memory with it) and
its mappings. Every other wait is bounded by ``timeout_s``. A receiver refuses a version older than
``min_version`` at its first bucket, so a stale push costs one bucket, not a model.

Choosing it: ``weightsync.backend: auto`` picks ``ipc`` when every server reports the trainer's host and,
for a GPU sender, the same physical GPU (:func:`colocated`; devices compare by UUID, since
CUDA_VISIBLE_DEVICES numbers them differently in each process).

Worked example: see :mod:`slipstream.weightsync.base`; ``build_topology`` gives the sender every
receiver's rendezvous and each receiver the sender's (socket path and secret).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.utils.tensors import total_nbytes
from slipstream.weightsync.base import TRANSPORTS, Transport, WeightStream
from slipstream.weightsync.buckets import BucketError, BufferPool, Layout, PackedBucket, StagingArea
from slipstream.weightsync.errors import TransferAborted, TransferError
from slipstream.weightsync.ipc_memory import (
    CudaMemory,
    HostMemory,
    device_identity,
    host_identity,
    memory_for,
    shm_room,
)
from slipstream.weightsync.types import InitInfo, IpcMessage, Rendezvous

log = get_logger(__name__)
_decoder = msgspec.msgpack.Decoder(IpcMessage)
_encoder = msgspec.msgpack.Encoder()
_HEADER = struct.Struct("!I")
_MAX_FDS = 16


class _SharedPool(BufferPool):
    """The sender's two shared buffers: fixed once shared, so a bucket that does not fit is an error."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__(buffers[0].device, slots=len(buffers))
        self._buffers = list(buffers)

    def _grow(self, slot: int, nbytes: int, keep: int) -> torch.Tensor:
        buf = self._buffers[slot]
        assert buf is not None
        if nbytes > buf.numel():
            raise BucketError(f"a bucket of {nbytes} bytes exceeds the {buf.numel()}-byte shared buffer")
        return buf


# --------------------------------------------------------------------------------------------- framing


def _send(sock: socket.socket, msg: IpcMessage, fds: list[int] | None = None) -> None:
    body = _encoder.encode(msg)
    frame = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(sock: socket.socket, with_fds: bool = False) -> tuple[IpcMessage | None, list[int]]:
    """One message (None at the end of the stream) and the descriptors that came with its first bytes."""
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
        if head and len(head) < _HEADER.size:
            head += _read_exact(sock, _HEADER.size - len(head)) or b""
    else:
        head = _read_exact(sock, _HEADER.size)
    if not head or len(head) < _HEADER.size:
        return None, fds
    body = _read_exact(sock, _HEADER.unpack(head)[0])
    if body is None:
        return None, fds
    return _decoder.decode(body), fds


class _Conn:
    """One control connection; a reader thread files incoming messages in an inbox that :meth:`take`
    searches, so the owner sees a peer's death (``closed``) the moment the stream ends."""

    def __init__(self, sock: socket.socket, label: str, on_close: Callable[[bool], None] | None = None):
        self.sock = sock
        self.label = label
        self.closed: str | None = None
        self._inbox: collections.deque[IpcMessage] = collections.deque()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._on_close = on_close
        self._closing = False  # closed from this side: not the peer's doing
        sock.settimeout(None)
        self._thread = threading.Thread(target=self._read_loop, name=f"ipc-{label}", daemon=True)
        self._thread.start()

    def send(self, msg: IpcMessage) -> None:
        try:
            with self._send_lock:
                _send(self.sock, msg)
        except OSError as err:
            raise TransferError(f"{self.label} went away ({type(err).__name__}: {err})") from err

    def take(
        self,
        accept: Callable[[IpcMessage], bool],
        timeout_s: float,
        what: str,
        fail: Callable[[IpcMessage], bool] | None = None,
    ) -> IpcMessage:
        """The first message ``accept`` takes (removed from the inbox); TransferError when the peer is
        gone, ``timeout_s`` passes, or a message ``fail`` matches is waiting."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, msg in enumerate(self._inbox):
                    if accept(msg):
                        del self._inbox[i]
                        return msg
                failed = next((m for m in self._inbox if fail is not None and fail(m)), None)
                if failed is not None:
                    raise TransferError(f"{self.label} failed version {failed.version}: {failed.error}")
                if self.closed is not None:
                    raise TransferError(f"{self.label} {self.closed} (while waiting for {what})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"no {what} from {self.label} within {timeout_s:g} s")
                self._cond.wait(left)

    def purge(self, stale: Callable[[IpcMessage], bool]) -> None:
        with self._cond:
            self._inbox = collections.deque(m for m in self._inbox if not stale(m))

    def close(self, bye: bool = False) -> None:
        self._closing = True
        if bye and self.closed is None:
            try:
                self.send(IpcMessage(kind="bye"))
            except TransferError as err:
                log.debug("saying goodbye to %s: %s", self.label, err)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=10)
        self.sock.close()

    def _read_loop(self) -> None:
        bye, reason = False, "went away (its connection ended)"
        try:
            while True:
                msg, _ = _read(self.sock)
                if msg is None:
                    break
                if msg.kind == "bye":
                    bye, reason = True, "closed the connection"
                    break
                with self._cond:
                    self._inbox.append(msg)
                    self._cond.notify_all()
        except (OSError, msgspec.DecodeError, ValueError) as err:
            reason = f"went away ({type(err).__name__}: {err})"
        with self._cond:
            self.closed = reason
            self._cond.notify_all()
        if self._on_close is not None and not self._closing:
            self._on_close(bye)


# ------------------------------------------------------------------------------------------- transport


@TRANSPORTS.register("ipc")
class IpcTransport(Transport):
    """Sender or receiver of ``ipc`` weight pushes (see the module docstring).

    Sender: ``prepare`` allocates the two shared buffers and listens; ``connect`` accepts one
    connection per receiver and shares the buffers with it. Receiver: ``prepare`` reports where it runs;
    ``connect`` maps the sender's buffers. ``min_version`` (receiver) refuses older
    versions. Staging memory is allocated per version and lives only as long as that version's tensors:
    once the target copied them in, or the version failed, it is gone (a colocated server does not keep a
    second copy of the model between versions).
    """

    joins = "stream"

    def __init__(self, cfg, *, is_sender: bool, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        self.memory: HostMemory | CudaMemory = CudaMemory() if self.device.type == "cuda" else HostMemory()
        self.pool: _SharedPool | None = None
        self._staged: list[weakref.ref] = []  # receiver: the buffers of the last version's staging
        self._secret = secrets.token_hex(16) if is_sender else ""
        self._dir: str | None = None
        self._listener: socket.socket | None = None
        self._conns: list[_Conn] = []
        self._broken = ""
        self._push = 0  # sender: pushes started; receiver: the last push it finished or dropped
        self._mapped: list[torch.Tensor] = []
        self._map_lock = threading.Lock()
        self._socket_path = ""

    # -- rendezvous

    def layout(self) -> Layout:
        return Layout.slipstream(self.bucket_bytes)  # no direct segments: every byte goes through a buffer

    def prepare(self) -> Rendezvous:
        me = Rendezvous(backend=self.name, host=host_identity(), device=device_identity(self.device))
        if not self.is_sender:
            return me
        if self.pool is None:
            capacity = Layout.slipstream(self.bucket_bytes).capacity
            room = shm_room() if self.memory.kind == "cpu" else None
            if room is not None and room < 2 * capacity:
                raise TransferError(
                    f"ipc needs 2 × {capacity >> 20} MiB of /dev/shm, {room >> 20} MiB are free "
                    "(lower weightsync.bucket_mb or give the container a larger /dev/shm)"
                )
            self.pool = _SharedPool([self.memory.allocate(capacity, self.device) for _ in range(2)])
        if self._listener is None:
            self._listen()
        me.address, me.secret = self._socket_path, self._secret
        return me

    def _listen(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="slipstream-ipc-")  # 0700: only this user may connect
        if len(self._dir) > 90:  # AF_UNIX paths are limited to ~100 bytes
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = tempfile.mkdtemp(prefix="slipstream-ipc-", dir="/tmp")
        self._socket_path = os.path.join(self._dir, "sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self._socket_path)
        sock.listen(128)
        self._listener = sock

    def connect(self, info: InitInfo) -> None:
        if (info.rank == 0) != self.is_sender:
            raise ValueError(f"rank {info.rank} given to a {'sender' if self.is_sender else 'receiver'}")
        if self.is_sender:
            self._accept_all(len(info.peers))
        else:
            if len(info.peers) != 1 or not info.peers[0].address:
                raise ValueError("an ipc receiver needs exactly one sender peer with its socket path")
            self._connect(info.peers[0], info.rank)

    def fail(self) -> None:
        self.close()

    def close(self) -> None:
        self._close_conns()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes an accept() blocked in another thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._release_mappings()
        self.pool = None  # the shared buffers go with the last reference (a receiver's mapping included)

    # -- sender: connections

    def _accept_all(self, count: int) -> None:
        if self.pool is None or self._listener is None:
            raise RuntimeError("call prepare() on the sender before connect()")
        self._close_conns()
        listener, deadline = self._listener, time.monotonic() + self.cfg.timeout_s
        conns: list[_Conn] = []
        try:
            while len(conns) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(
                        f"{len(conns)} of {count} receivers connected within {self.cfg.timeout_s:g} s"
                    )
                listener.settimeout(left)
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as err:  # close() closed the listener: the join was given up
                    raise TransferError(f"the ipc sender stopped accepting receivers ({err})") from err
                conn = self._welcome(sock, deadline)
                if conn is not None:
                    conns.append(conn)
        except BaseException:
            for conn in conns:
                conn.close(bye=True)
            raise
        self._conns, self._broken = conns, ""

    def _welcome(self, sock: socket.socket, deadline: float) -> _Conn | None:
        """Check a new connection's hello, share the buffers with it, wait until it mapped them."""
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            hello, _ = _read(sock)
            if hello is None or hello.kind != "hello" or not hmac.compare_digest(hello.secret, self._secret):
                log.warning("ipc: refused a connection that did not present this sender's secret")
                sock.close()
                return None
            shared = [self.memory.share(buf) for buf in self.pool.buffers]
            offer = IpcMessage(
                kind="buffers", device=device_identity(self.device), buffers=[d for d, _ in shared]
            )
            _send(sock, offer, [fd for _, fd in shared if fd is not None])
            ready, _ = _read(sock)
        except (OSError, msgspec.DecodeError) as err:
            sock.close()
            raise TransferError(f"a receiver failed while joining: {type(err).__name__}: {err}") from err
        if ready is None or ready.kind != "ready" or not ready.ok:
            sock.close()
            why = ready.error if ready is not None else "it went away"
            raise TransferError(f"receiver {hello.name} could not map the shared buffers: {why}")
        return _Conn(sock, f"receiver {hello.name}")

    def _close_conns(self) -> None:
        for conn in self._conns:
            conn.close(bye=self.is_sender)
        self._conns = []

    # -- sender: pushing

    def _before_send(self, version: int) -> None:
        if self.pool is None or not self._conns:
            raise TransferError("ipc: call prepare() and connect() before send_weights()")
        if self._broken:
            raise TransferError(f"ipc: {self._broken} in an earlier push; rebuild the group")
        self._push += 1
        push = self._push
        for conn in self._conns:
            conn.purge(lambda m: m.push < push)  # answers to pushes that were given up

    def _ready(self, bucket: PackedBucket) -> PackedBucket:
        self.memory.published(self.device)  # visible to other processes before it is announced
        return bucket

    def start_bucket(self, bucket: PackedBucket) -> Awaitable[None]:
        meta, push, conns = bucket.meta, self._push, list(self._conns)
        notice = IpcMessage(
            kind="bucket", push=push, version=meta.version, index=meta.index, slot=bucket.slot, meta=meta
        )
        try:
            for conn in conns:
                conn.send(notice)
        except TransferError as err:
            return _raise(err)
        return asyncio.to_thread(self._await_acks, conns, push, meta.index)

    def _await_acks(self, conns: list[_Conn], push: int, index: int) -> None:
        for conn in conns:
            conn.take(
                lambda m: m.kind == "ack" and m.push == push and m.index == index and m.ok,
                self.cfg.timeout_s,
                f"acknowledgement of bucket {index}",
                fail=lambda m: m.kind == "ack" and m.push == push and not m.ok,
            )

    def _abort(self, version: int, err: BaseException) -> None:
        for conn in self._conns:
            if conn.closed is None:
                try:
                    conn.send(IpcMessage(kind="abort", push=self._push, version=version))
                except TransferError as send_err:
                    log.debug("telling %s to drop version %d: %s", conn.label, version, send_err)
        gone = [c.label for c in self._conns if c.closed is not None]
        if gone:
            self._broken = f"{', '.join(gone)} went away"

    # -- receiver: connection

    def _connect(self, sender: Rendezvous, rank: int) -> None:
        if sender.host != host_identity():
            raise TransferError(f"ipc joins processes of one host; the sender runs on {sender.host}")
        self._close_conns()
        self._release_mappings()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.cfg.timeout_s)
        fds: list[int] = []
        try:
            sock.connect(sender.address)
            _send(
                sock, IpcMessage(kind="hello", secret=sender.secret, name=f"rank {rank} (pid {os.getpid()})")
            )
            offer, fds = _read(sock, with_fds=True)
            if offer is None or offer.kind != "buffers":
                raise TransferError("the sender refused this receiver or went away while it joined")
            try:
                self._map(offer, fds)
            except Exception as err:
                _send(sock, IpcMessage(kind="ready", ok=False, error=f"{type(err).__name__}: {err}"))
                raise TransferError(f"could not map the sender's buffers: {err}") from err
            finally:
                fds = []
            _send(sock, IpcMessage(kind="ready"))
        except OSError as err:
            sock.close()
            raise TransferError(f"could not join the ipc sender at {sender.address}: {err}") from err
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._socket_path, self._push = sender.address, 0  # a new sender counts its pushes from 1
        self._conns = [_Conn(sock, "the sender", on_close=self._sender_gone)]

    def _map(self, offer: IpcMessage, fds: list[int]) -> None:
        memory = memory_for(offer.device)
        host = memory.kind == "cpu"
        if host and len(fds) != len(offer.buffers):
            raise TransferError(f"{len(offer.buffers)} buffers arrived with {len(fds)} descriptors")
        mapped = []
        for i, desc in enumerate(offer.buffers):
            mapped.append(memory.open(desc, fds[i] if host else None))
        with self._map_lock:
            self.memory, self._mapped = memory, mapped

    def _release_mappings(self) -> None:
        with self._map_lock:  # never while a copy out of them runs
            self._mapped = []

    def _sender_gone(self, bye: bool) -> None:
        """Runs on the reader thread when the sender's connection ends: let go of its buffers now; after
        a death also of the socket directory it can no longer remove."""
        self._release_mappings()
        if not bye:
            path = self._socket_path
            if path:
                try:
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass

    @property
    def mapped(self) -> int:
        """How many of the sender's buffers this receiver maps."""
        return len(self._mapped)

    @property
    def staging_bytes(self) -> int:
        """Staging memory of the last version still alive (0 once it was applied and let go, or failed)."""
        return total_nbytes(ref() for ref in self._staged)

    # -- receiver: versions

    def receive_weights(self) -> WeightStream:
        return WeightStream(self._receive)

    async def _receive(self, stream: WeightStream) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if not self._conns or self.is_sender:
            raise TransferError("ipc: call prepare() and connect() before receive_weights()")
        conn, settled = self._conns[0], self._push
        self._staged = []
        staging = StagingArea(self.device, on_alloc=lambda t: self._staged.append(weakref.ref(t)))
        stream.staging = staging
        conn.purge(lambda m: m.push <= settled)  # what is left of pushes already finished or dropped
        push, index, meta = None, 0, None
        try:
            while True:
                msg = await asyncio.to_thread(
                    conn.take,
                    lambda m, i=index, p=push: (
                        m.push > settled
                        and (p is None or m.push == p)
                        and (m.kind == "abort" or (m.kind == "bucket" and m.index == i))
                    ),
                    self.cfg.timeout_s,
                    f"bucket {index}",
                )
                if msg.kind == "abort":
                    raise TransferAborted(f"the sender dropped version {msg.version}")
                push, meta = msg.push, msg.meta
                if meta is None:
                    raise TransferError(f"bucket notice {index} carries no metadata")
                if stream.version is None:
                    self.check_version(meta.version)
                    stream.version, stream.started = meta.version, time.perf_counter()
                    staging.begin(meta.version)
                try:
                    await asyncio.to_thread(self._copy_in, staging, msg)
                    done = staging.commit(meta)  # digests checked before the ack
                except BucketError as err:
                    raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
                conn.send(IpcMessage(kind="ack", push=push, version=meta.version, index=meta.index))
                stream.nbytes += meta.nbytes
                for item in done:
                    yield item
                if meta.last:
                    if not staging.complete:
                        raise TransferError(
                            f"version {meta.version} ended with a tensor only partly received"
                        )
                    return
                index += 1
        except BaseException as err:
            self._drop(conn, push, index, meta, err)
            raise
        finally:
            if push is not None:
                self._push = max(self._push, push)

    def _copy_in(self, staging: StagingArea, msg: IpcMessage) -> None:
        meta = msg.meta
        dest = staging.destination(meta)
        if not meta.nbytes:
            return
        with self._map_lock:
            if not self._mapped:
                raise TransferError("the sender's buffers are no longer mapped (it went away)")
            if not 0 <= msg.slot < len(self._mapped) or meta.nbytes > self._mapped[msg.slot].numel():
                raise BucketError(f"bucket {meta.index} does not fit the sender's buffer {msg.slot}")
            dest.copy_(self._mapped[msg.slot][: meta.nbytes])
            self.memory.copied(dest.device)

    def _drop(self, conn: _Conn, push: int | None, index: int, meta, err: BaseException) -> None:
        """A version that will not complete: tell a live sender, so it stops waiting (its staging goes with
        the stream)."""
        if push is not None and conn.closed is None and not isinstance(err, TransferAborted):
            why = str(err) or type(err).__name__
            nack = IpcMessage(
                kind="ack", push=push, version=meta.version if meta else 0, index=index, ok=False, error=why
            )
            try:
                conn.send(nack)
            except TransferError as send_err:
                log.debug("could not tell the sender: %s", send_err)


async def _raise(err: BaseException) -> None:
    raise err
