"""The direct channel: same-host clients send their control requests over a plain Unix domain socket.

Why not ZeroMQ here: every ZeroMQ message crosses an IO thread on each side, so one round trip wakes four
threads more than the two processes themselves. Where waking a thread is expensive (the benchmark VM), that
is most of the cost: a bare pyzmq echo between two processes took 111 µs p50 over ``ipc://`` and 168 µs over
TCP loopback, the same echo over a plain Unix socket 13 µs. Control requests (HELLO, COMMIT, LEASE, ACK, ...,
and puts of groups whose tensors all ride inline) are small, carry no payload frames, and are what small-group
throughput and latency are made of, so same-host clients send them here. Payload frames (PUT, FETCH) stay on
ZeroMQ's unit sockets; clients on other hosts use ZeroMQ for everything. No maintained library offers a
framed, typed request channel over a Unix socket that plugs into the server's ZeroMQ poller, so this one is
written by hand and kept minimal.

Framing: a stream of ``u32 length (little-endian) | type byte | msgpack header`` messages: the same type byte
and typed header as on ZeroMQ, no payload frames, nothing pickled. A length over the server's limit gets an
ERROR reply and the connection is closed (the stream cannot be resynchronised); any other malformed message
gets an ERROR reply like on ZeroMQ. The listening socket has a Linux abstract name: no file to clean up, and
only processes in the server's network namespace (on its host) can connect.

Server side: :class:`DirectListener` and :class:`DirectConn` are driven by the server loop (their
descriptors sit in its ZeroMQ poller); writes that do not fit the socket buffer wait in the connection's
output buffer until it is writable. Memory per connection is bounded both ways: at most ``_FILL_MAX`` bytes
are read per wake-up, and the server stops taking requests from a connection whose unread replies exceed
``queue.direct_max_unread_bytes`` until the client reads them (so a client that never reads ends up blocked
in its own send). Client side: :class:`DirectSocket` offers the few ``zmq.Socket`` methods the
clients use (``send_multipart``, ``poll``, ``recv_multipart``, ``getsockopt(FD/EVENTS)``, ``close``), so both
clients drive it exactly like their ZeroMQ sockets.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import zmq

from slipstream.queue.errors import QueueUnreachable

_LEN = struct.Struct("<I")
# Control messages are headers only; this bounds what a peer can make either side buffer.
MAX_FRAME = 64 << 20
_READ = 1 << 16
_FILL_MAX = 1 << 20  # bytes read from one connection per wake-up of the server loop


def abstract_address(endpoint: str) -> str:
    """``unix:@name`` -> the socket address of that abstract name."""
    if not endpoint.startswith("unix:@"):
        raise ValueError(f"direct endpoint {endpoint!r}: expected unix:@NAME")
    return "\0" + endpoint[len("unix:@") :]


def reachable(endpoint: str) -> bool:
    """Whether a listener serves ``endpoint`` in this network namespace, i.e. on this host."""
    if not endpoint.startswith("unix:@") or not hasattr(socket, "AF_UNIX"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(abstract_address(endpoint))
        except OSError:
            return False
    return True


def _frame(parts: Sequence[Any]) -> bytes:
    body = b"".join(bytes(p) for p in parts)
    return _LEN.pack(len(body)) + body


class FrameTooLarge(Exception):
    pass


class _Reader:
    """Splits a byte stream into ``[type, header]`` messages."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.buf = bytearray()

    def take(self) -> list[bytes] | None:
        """The next complete message as ``[type byte, header]``, or None; FrameTooLarge on a bad length."""
        if len(self.buf) < 4:
            return None
        (n,) = _LEN.unpack_from(self.buf)
        if n > self.max_frame:
            raise FrameTooLarge(
                f"a direct-channel message of {n} bytes exceeds the limit of {self.max_frame}"
            )
        if len(self.buf) < 4 + n:
            return None
        body = bytes(self.buf[4 : 4 + n])
        del self.buf[: 4 + n]
        return [body[:1], body[1:]]

    @property
    def ready(self) -> bool:
        return len(self.buf) >= 4 and len(self.buf) >= 4 + _LEN.unpack_from(self.buf)[0]


# ------------------------------------------------------------------------------------------------- server
class DirectConn:
    """One accepted client connection (server side, loop thread only)."""

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.closed = False
        self.watched = zmq.POLLIN  # what the server's poller waits for on it
        self._reader = _Reader(max_frame)
        self._out = bytearray()

    @property
    def pending(self) -> bool:
        return bool(self._out)

    @property
    def unread_bytes(self) -> int:
        """Replies queued for the client and not yet taken by its socket."""
        return len(self._out)

    def fill(self) -> None:
        """Read what has arrived, at most ``_FILL_MAX`` bytes (the rest waits in the kernel, so a client
        that sends without pause cannot grow this buffer); sets ``closed`` at end of stream."""
        got = 0
        while got < _FILL_MAX:
            try:
                chunk = self.sock.recv(_READ)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self._reader.buf += chunk
            got += len(chunk)
            if len(chunk) < _READ:
                return

    def take(self) -> list[bytes] | None:
        """The next complete message received, or None. Raises FrameTooLarge."""
        return self._reader.take()

    def send(self, parts: Sequence[Any]) -> bool:
        """Queue one message and write what the socket takes now; True while output is left over."""
        if self.closed:
            return False
        self._out += _frame(parts)
        return self.flush()

    def flush(self) -> bool:
        while self._out:
            try:
                n = self.sock.send(self._out)
            except BlockingIOError:
                return True
            except OSError:
                self.closed = True
                self._out.clear()
                return False
            del self._out[:n]
        return False

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class DirectListener:
    """The server's listening socket on an abstract name (``endpoint`` is what HELLO advertises)."""

    def __init__(self, name: str) -> None:
        self.endpoint = f"unix:@{name}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(abstract_address(self.endpoint))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()

    def accept(self, max_frame: int) -> list[DirectConn]:
        conns = []
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return conns
            except OSError:
                return conns  # e.g. out of descriptors: try again on the next wake-up
            conns.append(DirectConn(sock, max_frame))

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------------------------------------- client
class DirectSocket:
    """A client's connection, with the ``zmq.Socket`` methods the queue clients call.

    Sends are blocking with the client's timeout (a control message is far smaller than the socket buffer,
    so a send waits only if the server stopped reading); receives never block beyond ``poll``'s timeout.
    """

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(abstract_address(endpoint))
        self._fd = self._sock.fileno()  # O_NONBLOCK underneath (settimeout): os.read never blocks
        self._reader = _Reader(MAX_FRAME)
        self._broken = ""
        self._poller = select.poll()  # not select.select: descriptors above 1024 are fine
        self._poller.register(self._fd, select.POLLIN)

    def send_multipart(self, frames: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        if len(frames) > 2:
            raise ValueError("the direct channel carries no payload frames")
        try:
            self._sock.sendall(_frame(frames))
        except OSError as err:  # a message is either whole on the stream or never sent: the latter here
            broken = f"direct channel to the queue server: send failed: {err}"
            raise QueueUnreachable(broken, sent=False) from None

    def _fill(self) -> None:
        """Read what has arrived; raises QueueUnreachable once the server has closed the connection."""
        while not self._broken:
            try:
                chunk = os.read(self._fd, _READ)
            except BlockingIOError:
                return
            except OSError as err:
                chunk, self._broken = b"", f"receive failed: {err}"
            if not chunk:
                self._broken = self._broken or "the queue server closed the connection"
                break
            self._reader.buf += chunk
            if len(chunk) < _READ:
                return
        if not self._reader.ready:
            raise QueueUnreachable(f"direct channel to the queue server: {self._broken}", sent=True)

    def poll(self, timeout_ms: float = -1, flags: int = zmq.POLLIN) -> int:
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms >= 0 else None
        while True:
            self._fill()
            if self._reader.ready:
                return zmq.POLLIN
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return 0
            self._poller.poll(None if left is None else max(1, int(left * 1000)))

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[bytes]:
        if not self._reader.ready and not (flags & zmq.NOBLOCK):
            self.poll()
        msg = self._reader.take()
        if msg is None:
            raise zmq.Again()
        return msg

    def getsockopt(self, option: int) -> int:
        if option == zmq.FD:
            return self._fd
        if option == zmq.EVENTS:
            self._fill()
            return zmq.POLLIN if self._reader.ready else 0
        raise ValueError(f"the direct channel has no socket option {option}")

    def close(self, linger: int | None = None) -> None:
        self._sock.close()
