"""Storage units: the queue's data plane.

A unit owns a socket of its own (payloads never cross the controller's socket, so a 256 MiB put cannot
delay a lease or an ack) and two kinds of storage:

* a **blob store** of buffers that arrived over the socket, kept as the received ZeroMQ frames themselves
  (no copy on receipt, none when they are sent back out: a frame can be sent again with ``copy=False``),
  plus blobs read back from a snapshot;
* an optional shared-memory :class:`~slipstream.queue.arena.Arena` that same-host clients write into and
  read from directly; the controller allocates its regions, since it decides admission anyway.

Units live in the server process and are driven by its loop thread; each socket is served by ZeroMQ IO
threads (``io_threads``), which is where the bytes actually move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from slipstream.queue import protocol as P
from slipstream.queue.arena import Arena
from slipstream.queue.codec import ZERO_COPY_MIN_BYTES, tracked_frame


class StorageUnit:
    """One unit: ``index`` in the server, its bound socket and port, its blob store and arena."""

    def __init__(self, index: int, socket: zmq.Socket, port: int, arena: Arena | None, ipc: str = "") -> None:
        self.index = index
        self.socket = socket
        self.port = port
        self.arena = arena
        self.ipc = ipc
        self._blobs: dict[int, list[Any]] = {}

    def store(self, token: int, buffers: list[Any]) -> None:
        self._blobs[token] = buffers

    def blobs(self, token: int) -> list[Any]:
        return self._blobs[token]

    def frames(
        self, token: int, arena_offset: int, nbytes: int, track: Callable[[Any, Callable[[], None]], None]
    ) -> list[Any]:
        """A group's buffers, ready to send: its blobs, or its arena region (``arena_offset >= 0``).

        A large region goes zero-copy and stays pinned until ZeroMQ's tracker says it was sent (the lease
        could be acked and the region reused before that); ``track(tracker, on_sent)`` arranges the unpin.
        A small one is simply copied.
        """
        if arena_offset < 0:
            return self._blobs[token]
        view = self.arena.buffer(arena_offset, nbytes)
        if nbytes < ZERO_COPY_MIN_BYTES:
            return [view.tobytes()]
        frame = tracked_frame(view)
        self.arena.pin(arena_offset)
        track(frame.tracker, lambda: self.arena.unpin(arena_offset))
        return [frame]

    def drop(self, token: int) -> None:
        del self._blobs[token]

    def info(self) -> P.UnitInfo:
        if self.arena is None:
            return P.UnitInfo(self.port, ipc=self.ipc)
        return P.UnitInfo(self.port, self.arena.path, self.arena.size, self.ipc)

    def close(self) -> None:
        self._blobs.clear()
        if self.arena is not None:
            self.arena.close()
