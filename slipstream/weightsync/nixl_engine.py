"""``nixl``: receivers READ each bucket from the sender's registered buffers over NIXL (UCX).

Pull, not push: the sender packs bucket *i* into one of its two registered buffers and sends each receiver
a notification carrying the bucket's metadata; every receiver READs the payload straight into its staging
memory (registered with NIXL when first allocated), then acknowledges. The sender reuses a buffer once
every receiver acknowledged it, and packs bucket *i+1* while the receivers read bucket *i*. K receivers read
in parallel, so the sender's link is not divided K ways in software. The same code runs on CPU DRAM (tests,
CI) and GPU memory (``VRAM``, RDMA or NVLink through UCX).

What crosses the wire is ours: the rendezvous (:class:`Rendezvous`: agent name, NIXL's agent-metadata blob,
and the sender's buffer addresses as plain integers) and msgpack :class:`NixlNotice` messages. NIXL's own
``get_serialized_descs`` produces pickles, so we never use it: descriptors are built locally from the
addresses the sender published. The agent-metadata blob comes from NIXL's C++ serializer (not pickle) and
is accepted only from the peer the controller paired us with.

Failure behaviour: every poll has a deadline (``timeout_s``); a READ that errors or a receiver that reports
a failure fails the send, and the sender tells the others to drop the version (``abort``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import TRANSPORTS, Transport, WeightStream
from slipstream.weightsync.buckets import BucketError, BufferPool, Layout, PackedBucket, StagingArea
from slipstream.weightsync.errors import TransferAborted, TransferError
from slipstream.weightsync.types import InitInfo, NixlNotice, Rendezvous

log = get_logger(__name__)
_notice = msgspec.msgpack.Decoder(NixlNotice)


def _new_agent(name: str):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as err:  # nixl is an optional extra (slipstream[nixl])
        raise RuntimeError(
            "backend `nixl` needs the `nixl` package (pip install 'slipstream[nixl]')"
        ) from err
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


@TRANSPORTS.register("nixl")
class NixlTransport(Transport):
    """Sender or receiver of NIXL weight pushes (see the module docstring).

    The sender's two transfer buffers are allocated and registered in ``prepare()`` and never grow: the
    ``slipstream`` bucket layout keeps every payload within ``bucket_mb``.
    """

    joins = "stream"

    def __init__(self, cfg, *, is_sender: bool, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.dev_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.agent = None
        self.agent_name = f"slipstream-{'send' if is_sender else 'recv'}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._registered: list = []
        self._peers: list[str] = []
        self._sender_buffers: list[tuple[int, int, int]] = []
        self._sender_mem_type = "DRAM"  # where the sender's buffers live: the remote side of every READ
        self._inbox: list[tuple[str, NixlNotice]] = []
        self._inbox_lock = threading.Lock()
        self._prepared = False
        self.pool: BufferPool | None = None
        self.staging: StagingArea | None = None

    # -- rendezvous

    def prepare(self) -> Rendezvous:
        if self.agent is None:
            self.agent = _new_agent(self.agent_name)
        if self.is_sender and self.pool is None:
            self.pool = BufferPool(self.device, slots=2, on_alloc=self._register_send_buffer)
            self.pool.preallocate(Layout.slipstream(self.bucket_bytes).capacity)
        if not self.is_sender and self.staging is None:
            self.staging = StagingArea(self.device, on_alloc=self._register)
        self._prepared = True
        buffers = [(b.data_ptr(), b.numel(), self.dev_id) for b in self.pool.buffers] if self.pool else []
        return Rendezvous(
            backend=self.name,
            agent_name=self.agent_name,
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type=self.mem_type,
            buffers=buffers,
        )

    def connect(self, info: InitInfo) -> None:
        if self.agent is None:
            raise RuntimeError("call prepare() before connect()")
        if (info.rank == 0) != self.is_sender:
            raise ValueError(f"rank {info.rank} given to a {'sender' if self.is_sender else 'receiver'}")
        for peer in self._peers:
            self.agent.remove_remote_agent(peer)
        self._peers = [_as_str(self.agent.add_remote_agent(p.agent_metadata)) for p in info.peers]
        if not self.is_sender:
            if len(info.peers) != 1 or not info.peers[0].buffers:
                raise ValueError("a NIXL receiver needs exactly one sender peer with its buffer addresses")
            self._sender_buffers = [tuple(b) for b in info.peers[0].buffers]
            self._sender_mem_type = info.peers[0].mem_type or "DRAM"
        self._inbox.clear()

    def fail(self) -> None:
        self.close()

    def close(self) -> None:
        if self.agent is None:
            return
        for peer in self._peers:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception as err:  # already gone: nothing to release
                log.debug("remove_remote_agent(%s): %s", peer, err)
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception as err:
                log.debug("deregister_memory: %s", err)
        self._peers, self._registered = [], []
        self.agent = None
        self.pool = None
        self.staging = None

    def _register(self, tensor: torch.Tensor) -> None:
        self._registered.append(self.agent.register_memory(tensor))

    def _register_send_buffer(self, tensor: torch.Tensor) -> None:
        if self._prepared:
            raise TransferError("NIXL send buffers cannot grow after prepare() (a bucket exceeded bucket_mb)")
        self._register(tensor)

    # -- notifications

    def _notify(self, peer: str, notice: NixlNotice) -> None:
        self.agent.send_notif(peer, msgspec.msgpack.encode(notice))

    def _poll(self, pick: Callable[[str, NixlNotice], bool], what: str) -> tuple[str, NixlNotice]:
        """Block (in a worker thread) until a notice ``pick`` accepts arrives; TransferError on timeout.
        Two buckets' acknowledgements are awaited from two threads: the inbox and the agent go under a lock."""
        deadline = time.monotonic() + self.cfg.timeout_s
        delay = 0.0002
        while True:
            with self._inbox_lock:
                found = self._take(pick)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TransferError(f"no {what} within {self.cfg.timeout_s} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _take(self, pick: Callable[[str, NixlNotice], bool]) -> tuple[str, NixlNotice] | None:
        """The first notice ``pick`` accepts, from the inbox or fetched now into it (None: not yet)."""
        for fetched in (False, True):
            if fetched:
                try:
                    notifs = self.agent.get_new_notifs()
                except Exception as err:
                    raise TransferError(f"reading NIXL notifications failed: {err}") from err
                for peer, msgs in notifs.items():
                    for raw in msgs:
                        try:
                            self._inbox.append((_as_str(peer), _notice.decode(raw)))
                        except msgspec.DecodeError:
                            log.warning("ignoring an undecodable NIXL notification from %s", peer)
            for i, (peer, notice) in enumerate(self._inbox):
                if pick(peer, notice):
                    del self._inbox[i]
                    return peer, notice
        return None

    # -- sending

    def _before_send(self, version: int) -> None:
        if self.pool is None or not self._peers:
            raise TransferError("nixl: call prepare() and connect() before send_weights()")

    def _ready(self, bucket: PackedBucket) -> PackedBucket:
        """Copies into GPU memory are asynchronous, and a receiver told about a bucket reads it at once, so
        the packing stream is synchronised before any notice."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return bucket

    def start_bucket(self, bucket: PackedBucket) -> Awaitable[None]:
        meta = bucket.meta
        notice = NixlNotice(
            kind="bucket", version=meta.version, index=meta.index, slot=bucket.slot, meta=meta
        )

        async def run() -> None:  # both buffers may be out: the pipeline waits for the older one
            await asyncio.to_thread(self._notify_all, notice)
            await asyncio.to_thread(self._await_acks, meta)

        return run()

    def _abort(self, version: int, err: BaseException) -> None:
        self._notify_all(NixlNotice(kind="abort", version=version), True)

    def _notify_all(self, notice: NixlNotice, quiet: bool = False) -> None:
        for peer in self._peers:
            try:
                with self._inbox_lock:  # one thread at a time in the agent, as when buckets went one by one
                    self._notify(peer, notice)
            except Exception as err:
                if not quiet:
                    raise TransferError(f"could not notify {peer}: {err}") from err

    def _await_acks(self, meta) -> None:
        waiting = set(self._peers)
        while waiting:
            peer, ack = self._poll(
                lambda p, n: n.kind == "ack" and n.version == meta.version and n.index == meta.index,
                f"acknowledgement of bucket {meta.index} from {sorted(waiting)}",
            )
            if not ack.ok:
                raise TransferError(f"receiver {peer} failed bucket {meta.index}: {ack.error}")
            waiting.discard(peer)

    # -- receiving

    def receive_weights(self) -> WeightStream:
        return WeightStream(self._receive)

    async def _receive(self, stream: WeightStream) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.staging is None or not self._peers:
            raise TransferError("nixl: call prepare() and connect() before receive_weights()")
        sender = self._peers[0]
        stream.staging = self.staging
        index = 0
        while True:
            _, notice = await asyncio.to_thread(
                self._poll,
                lambda p, n, i=index: (
                    p == sender and (n.kind == "abort" or (n.kind == "bucket" and n.index == i))
                ),
                f"bucket {index} from the sender",
            )
            if notice.kind == "abort":
                raise TransferAborted(f"the sender dropped version {notice.version}")
            meta = notice.meta
            if meta is None:
                raise TransferError(f"bucket notice {index} carries no metadata")
            if stream.version is None:
                stream.version, stream.started = meta.version, time.perf_counter()
                self.staging.begin(meta.version)
            try:
                await asyncio.to_thread(self._read, sender, notice)
                # staged (and its digests checked) before the ack, so a bucket that failed verification is
                # the sender's error too, and never a crash of this receiver
                done = self.staging.commit(meta)
            except (TransferError, BucketError) as err:
                self._ack(sender, notice, str(err))
                raise TransferError(f"bucket {meta.index} of version {meta.version}: {err}") from err
            self._ack(sender, notice, "")
            stream.nbytes += meta.nbytes
            for item in done:
                yield item
            if meta.last:
                if not self.staging.complete:
                    raise TransferError(f"version {meta.version} ended with a tensor only partly received")
                return
            index += 1

    def _read(self, sender: str, notice: NixlNotice) -> None:
        meta = notice.meta
        dest = self.staging.destination(meta)
        if not meta.nbytes:
            return
        if not 0 <= notice.slot < len(self._sender_buffers):
            raise BucketError(f"slot {notice.slot} is not one of the sender's buffers")
        addr, length, dev = self._sender_buffers[notice.slot]
        if meta.nbytes > length:
            raise BucketError(f"bucket of {meta.nbytes} bytes exceeds the sender's {length}-byte buffer")
        try:
            handle = self._start_read(sender, dest, addr, dev, meta.nbytes)
        except Exception as err:  # NIXL raises its own error types (the peer disconnected, ...)
            raise TransferError(
                f"READ of bucket {meta.index} could not start: {type(err).__name__} {err}"
            ) from err
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.cfg.timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"READ of bucket {meta.index} did not finish in {self.cfg.timeout_s} s"
                    )
                time.sleep(0.0001)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"READ of bucket {meta.index} ended in state {state}")
        except TransferError:
            raise
        except Exception as err:
            raise TransferError(f"READ of bucket {meta.index} failed: {type(err).__name__} {err}") from err
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as err:
                log.debug("release_xfer_handle: %s", err)

    def _start_read(self, sender: str, dest: torch.Tensor, addr: int, dev: int, nbytes: int):
        local = self.agent.get_xfer_descs([(dest.data_ptr(), nbytes, self.dev_id)], self.mem_type)
        remote = self.agent.get_xfer_descs([(addr, nbytes, dev)], self._sender_mem_type)
        return self.agent.initialize_xfer("READ", local, remote, sender)

    def _ack(self, sender: str, notice: NixlNotice, error: str) -> None:
        ack = NixlNotice(kind="ack", version=notice.version, index=notice.index, ok=not error, error=error)
        try:
            self._notify(sender, ack)
        except Exception as err:
            log.warning("could not acknowledge bucket %d: %s", notice.index, err)
