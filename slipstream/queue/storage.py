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

from typing import Any

import zmq

from slipstream.queue import protocol as P
from slipstream.queue.arena import Arena


class StorageUnit:
    """One unit: ``index`` in the server, its bound socket and port, its blob store and arena."""

    def __init__(self, index: int, socket: zmq.Socket, port: int, arena: Arena | None) -> None:
        self.index = index
        self.socket = socket
        self.port = port
        self.arena = arena
        self._blobs: dict[int, list[Any]] = {}

    def store(self, token: int, buffers: list[Any]) -> None:
        self._blobs[token] = buffers

    def blobs(self, token: int) -> list[Any]:
        return self._blobs[token]

    def drop(self, token: int) -> None:
        del self._blobs[token]

    @property
    def blob_bytes(self) -> int:
        return sum(len(b) for bufs in self._blobs.values() for b in bufs)

    def info(self) -> P.UnitInfo:
        if self.arena is None:
            return P.UnitInfo(self.port)
        return P.UnitInfo(self.port, self.arena.path, self.arena.size)

    def close(self) -> None:
        self._blobs.clear()
        if self.arena is not None:
            self.arena.close()
