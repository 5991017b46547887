"""The TransferQueue server: one controller socket, N storage-unit sockets, one loop thread.

Three ways to run it, all the same :class:`QueueServer`:

* a plain process: ``start_queue_server(cfg)`` spawns ``python -m slipstream.queue.server`` and returns a
  :class:`QueueServerHandle` (``.address``, ``.stop()``, ``.is_alive()``); from a shell,
  ``slipstream queue serve --host 127.0.0.1 --port 5555 --num-storage-units 4 [--key VALUE ...]`` (every
  :class:`QueueConfig` field is an option, also a ``key=value`` override);
* inside a Ray actor: ``ray.remote(QueueServerActor).remote(cfg)`` then
  ``ray.get(actor.address.remote())``; the server's threads live in the actor process, which Ray places
  (pin it to a node with a custom resource in a cluster). Clients talk to it over ZeroMQ as usual;
* in this process: ``QueueServer(cfg).start()`` (tests, benchmarks).

It binds loopback unless ``queue.host`` says otherwise, and a server bound beyond loopback requires a token
from every client (:mod:`slipstream.queue.auth`); ``address`` then carries it (``tcp://TOKEN@host:port``).

Why one Python thread serves every socket: handlers only touch metadata and hand buffers to ZeroMQ
(``copy=False``), so each takes microseconds whatever the payload size; the bytes move in ZeroMQ's IO
threads (one per unit socket with ``io_threads``) and, for same-host clients, in the clients' own memcpy
into the arena. Separate Python threads per unit would only add GIL hand-offs to every request. Snapshot
and restore file IO runs on a worker thread so it never stalls the loop.

Robustness: every message is checked (frame count, total size, type byte, typed header, tensor specs
against the frames) before anything is stored; any failure is answered with an ERROR reply naming the
problem, and an exception inside a handler is logged and answered the same way, so no input stops the loop.
A single frame over twice ``max_message_bytes`` is dropped by ZeroMQ itself (``MAXMSGSIZE``), which
disconnects that sender and nothing else.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from slipstream.cli_args import add_config_options, command_parser, config_values
from slipstream.config_base import ConfigError, override_value, validate
from slipstream.queue import protocol as P
from slipstream.queue.arena import HEADER_BYTES, Arena, shm_supported
from slipstream.queue.auth import TOKEN_ENV, Gate, server_token, with_token
from slipstream.queue.codec import Codec, WireError, ipc_supported, send_frames
from slipstream.queue.config import QueueConfig
from slipstream.queue.controller import Controller
from slipstream.queue.direct import MAX_FRAME, DirectConn, DirectListener, FrameTooLarge
from slipstream.queue.storage import StorageUnit
from slipstream.utils.logging import get_logger
from slipstream.utils.net import routable_host

log = get_logger(__name__)

_ANNOUNCE = "SLIPSTREAM_QUEUE_ADDRESS"
_MAX_BATCH = 64  # messages taken from one socket before looking at the others (fairness)
# Plain ints: the enum arithmetic of zmq's constants costs microseconds on every message.
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


class QueueServer:
    """A queue server in this process. Lifecycle: construct (binds) → ``start()`` or ``serve_forever()``
    → ``stop()``. ``address`` is valid right after construction."""

    def __init__(self, cfg: QueueConfig) -> None:
        self.cfg = cfg
        token = server_token(cfg)  # before anything binds: a bind beyond loopback needs a token
        self._ctx = zmq.Context(io_threads=cfg.io_threads)
        self._gate = Gate(self._ctx, token)
        self._codec = Codec()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        nonce = secrets.token_bytes(16)
        # Same-host clients switch to Unix domain sockets after HELLO: the direct channel for control
        # requests, ipc:// for the units (abstract names: no file to leak, and only processes in this network
        # namespace, i.e. on this host, can reach them).
        use_unix = cfg.ipc and ipc_supported() and not token  # no ZeroMQ handshake on the direct channel
        self._ipc_prefix = f"ipc://@slipstream-queue-{nonce.hex()}" if use_unix else ""
        self._direct = DirectListener(f"slipstream-queue-{nonce.hex()}-direct") if use_unix else None
        self._conns: dict[int, DirectConn] = {}
        self._poller = zmq.Poller()
        self._socket, self.port = self._bind(cfg.port, "")
        self.units = [self._make_unit(i, nonce) for i in range(cfg.num_storage_units)]
        direct = self._direct.endpoint if self._direct is not None else ""
        self.controller = Controller(cfg, self.units, self._send, nonce, direct)
        handlers = {
            P.MsgType.HELLO: self.controller.handle_hello,
            P.MsgType.RESERVE: self.controller.handle_reserve,
            P.MsgType.COMMIT: self.controller.handle_commit,
            P.MsgType.LEASE: self.controller.handle_lease,
            P.MsgType.ACK: self.controller.handle_ack,
            P.MsgType.NACK: self.controller.handle_nack,
            P.MsgType.POP_DROPPED: self.controller.handle_pop_dropped,
            P.MsgType.STATS: self.controller.handle_stats,
            P.MsgType.SNAPSHOT: self.controller.handle_snapshot,
            P.MsgType.RESTORE: self.controller.handle_restore,
            P.MsgType.PING: self.controller.handle_ping,
            P.MsgType.QUARANTINE: self.controller.handle_quarantine,
        }
        self._routes: dict[Any, tuple[frozenset, dict[P.MsgType, Callable]]] = {
            self._socket: (P.CONTROLLER_TYPES, handlers)
        }
        for unit in self.units:
            unit_handlers = {
                P.MsgType.PUT: lambda r, h, b, i=unit.index: self.controller.handle_put(i, r, h, b),
                P.MsgType.FETCH: lambda r, h, b, i=unit.index: self.controller.handle_fetch(i, r, h, b),
                P.MsgType.PING: self.controller.handle_ping,
            }
            self._routes[unit.socket] = (P.UNIT_TYPES, unit_handlers)
        n_units = len(self.units)
        self._direct_handlers = {
            **handlers,
            P.MsgType.PUT: lambda r, h, b: self.controller.handle_put(
                P.unit_for(h.meta.group_id, n_units), r, h, b
            ),
        }
        log.info("queue server at %s with %d storage unit(s)", self._address, len(self.units))
        if token:
            log.info("clients must present the server's token (ZeroMQ PLAIN); it is in .address")

    # --------------------------------------------------------------------------------------- set-up
    def _bind(self, port: int, name: str) -> tuple[zmq.Socket, int]:
        """A ROUTER bound to ``host:port`` (0: a free port) and, given a ``name``, to its ipc endpoint;
        returns it and the port."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Bounded queues per peer: a sender faster than the loop is slowed by TCP; a reply to a peer that
        # does not read is dropped once its queue is full (ROUTER_MANDATORY makes that an error, see _send).
        sock.setsockopt(zmq.SNDHWM, self.cfg.zmq_hwm)
        sock.setsockopt(zmq.RCVHWM, self.cfg.zmq_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, min(2 * self.cfg.max_message_bytes, 2**62))
        self._gate.secure(sock)
        # A reply to a peer that is gone fails instead of vanishing, so a lease is never granted to it.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(f"tcp://{self.cfg.host}:{port}")
        bound = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        if self._ipc_prefix and name:
            sock.bind(self._ipc(name))
        return sock, bound

    def _ipc(self, name: str) -> str:
        return f"{self._ipc_prefix}-{name}" if self._ipc_prefix else ""

    def _make_unit(self, index: int, nonce: bytes) -> StorageUnit:
        sock, port = self._bind(0, f"unit{index}")
        arena = None
        size = self.cfg.shm_bytes_per_unit
        if self.cfg.shared_memory and shm_supported() and size > 2 * HEADER_BYTES:
            arena = Arena(size, nonce, name=f"slipstream-queue-unit{index}")
        return StorageUnit(index, sock, port, arena, self._ipc(f"unit{index}"))

    @property
    def _address(self) -> str:
        return f"tcp://{routable_host(self.cfg.host)}:{self.port}"

    @property
    def address(self) -> str:
        """What clients connect to: ``tcp://host:port``, with the token in front of the host when the
        server requires one (``tcp://TOKEN@host:port``; see :mod:`slipstream.queue.auth`)."""
        return with_token(self._address, self._gate.token)

    # ----------------------------------------------------------------------------------------- loop
    def start(self) -> QueueServer:
        self._thread = threading.Thread(target=self.serve_forever, name="queue-server", daemon=True)
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def serve_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller = self._poller
        for sock in self._routes:
            poller.register(sock, zmq.POLLIN)
        if self._direct is not None:
            poller.register(self._direct.fd, zmq.POLLIN)
        if self.controller.journal is not None:  # finished journal copies wake the loop (tick settles them)
            poller.register(self.controller.journal.fileno, zmq.POLLIN)
        try:
            journal = self.controller.journal
            while not self._stop.is_set() and not should_stop():
                wait = min(self.controller.tick(), 0.1)
                if journal is not None and not journal.before_wait():
                    wait = 0.0
                ready = poller.poll(wait * 1000)
                if journal is not None:
                    journal.after_wait()
                for sock, events in ready:
                    if sock in self._routes:
                        self._drain(sock)
                    elif sock in self._conns:
                        self._serve_conn(self._conns[sock], events)
                    elif self._direct is not None and sock == self._direct.fd:
                        for conn in self._direct.accept(min(MAX_FRAME, self.cfg.max_message_bytes)):
                            self._conns[conn.fd] = conn
                            poller.register(conn.fd, zmq.POLLIN)
                    else:
                        journal.clear_wakeups()
        finally:
            self._close()

    def _drain(self, sock: zmq.Socket) -> None:
        allowed, handlers = self._routes[sock]
        for _ in range(_MAX_BATCH):
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                return
            frames = sock.recv_multipart(copy=False)
            self._handle((sock, frames[0]), frames[1:], allowed, handlers)

    def _serve_conn(self, conn: DirectConn, events: int) -> None:
        if events & _POLLOUT:
            conn.flush()
        if events & _POLLIN and self._reading(conn):
            conn.fill()
        self._serve_buffered(conn)
        self._watch(conn)

    def _reading(self, conn: DirectConn) -> bool:
        """Whether to take more requests from ``conn``: not while its client leaves many replies unread."""
        return conn.unread_bytes <= self.cfg.direct_max_unread_bytes

    def _serve_buffered(self, conn: DirectConn) -> None:
        """Serve the complete requests ``conn`` has buffered, while its unread replies stay within bounds."""
        while self._reading(conn):
            try:
                body = conn.take()
            except FrameTooLarge as err:
                conn.send(self._codec.encode(P.MsgType.ERROR, P.ErrorReply(0, "too_large", str(err))))
                conn.closed = True
                return
            if body is None:
                return
            self._handle((conn, None), body, P.DIRECT_TYPES, self._direct_handlers)

    def _watch(self, conn: DirectConn) -> None:
        """Keep the poller in step with a connection: gone, waiting to write, reading, or both."""
        if conn.closed:
            if self._conns.pop(conn.fd, None) is not None:
                self._poller.unregister(conn.fd)
                conn.close()
                self.controller.forget(conn)  # its parked requests can never be answered
            return
        want = (_POLLIN if self._reading(conn) else 0) | (_POLLOUT if conn.pending else 0)
        if want != conn.watched:
            conn.watched = want
            self._poller.modify(conn.fd, want)

    def _handle(self, reply_to: tuple, body: list, allowed: frozenset, handlers: dict) -> None:
        req_id = 0
        try:
            msg_type, header, buffers = self._codec.decode_request(body, allowed, self.cfg.max_message_bytes)
            req_id = header.req_id
            handlers[msg_type](reply_to, header, buffers)
        except WireError as err:
            req_id = err.req_id or req_id
            if err.kind == "bad_request":  # one line, never a traceback: a peer may send them by the thousand
                log.warning("bad request %d: %s", req_id, err.message[:200])
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, err.kind, err.message))
        except Exception as err:  # noqa: BLE001 - no request may stop the loop
            log.exception("request failed")
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, "internal", repr(err)))

    def _send(self, reply_to: tuple, msg_type: int, header: msgspec.Struct, buffers: Any = ()) -> bool:
        """Send a reply; False when its requester is gone (or not reading), so nothing was handed over."""
        sock, identity = reply_to
        if identity is None:  # a direct-channel connection: control replies carry no payload frames
            if buffers:
                raise RuntimeError("a reply with payload frames cannot go over the direct channel")
            if sock.closed:
                return False
            sock.send(self._codec.encode(msg_type, header))
            if sock.closed:  # the loop unregisters it (and forgets its requests) when it polls it next
                return False
            self._watch(sock)
            return True
        try:
            send_frames(sock, [identity, *self._codec.encode(msg_type, header, buffers)], zmq.NOBLOCK)
        except zmq.ZMQError as err:
            if err.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            log.debug("reply %d dropped: its requester is gone or not reading (%s)", header.req_id, err)
            return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif not self._closed:
            self._close()  # never served: nothing else will release the sockets and arenas

    def _close(self) -> None:
        self._closed = True
        self.controller.close()
        for sock in self._routes:
            sock.close(linger=0)
        for conn in self._conns.values():
            conn.close()
        if self._direct is not None:
            self._direct.close()
        for unit in self.units:
            unit.close()
        self._gate.close()
        self._ctx.term()


def freeze_imports() -> None:
    """Exclude everything allocated so far (torch's import leaves ~150k objects) from the cyclic GC.

    Without it, each full collection walks all of torch's objects (about 0.1 s on a small CPU) while the
    server holds requests; with it, collections only see the queue's own objects. Call it once a process
    that hosts the server has finished importing (it is process-wide and harmless: frozen objects are just
    never collected).
    """
    gc.freeze()


# ------------------------------------------------------------------------------------ plain process
class QueueServerHandle:
    """A queue server running as a child process (see :func:`start_queue_server`)."""

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc = proc
        self.address = address

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL after ``timeout_s``; True once the process has exited. Never raises: a
        process still in the kernel after SIGKILL is logged and left (it cannot run any more code)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("queue server %d did not exit %.0f s after SIGTERM; killing it", self.proc.pid,
                            timeout_s)  # fmt: skip
                self.proc.kill()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.error("queue server %d still exiting %.0f s after SIGKILL", self.proc.pid, timeout_s)
                    return False
        return True

    def __enter__(self) -> QueueServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def config_args(cfg: QueueConfig) -> list[str]:
    """The ``--key value`` options that rebuild ``cfg`` in ``slipstream queue serve`` (a literal auth token is
    left out: it goes through ``$SLIPSTREAM_QUEUE_TOKEN``, not the command line others can read)."""
    args: list[str] = []
    for k, v in msgspec.to_builtins(cfg).items():
        if k != "auth_token" or v in ("auto", ""):
            args += ["--" + k.replace("_", "-"), "true" if v is True else "false" if v is False else str(v)]
    return args


def start_queue_server(cfg: QueueConfig, *, timeout_s: float = 60.0) -> QueueServerHandle:
    """Start a server process and return once it is bound; it exits when this process does."""
    cmd = [sys.executable, "-m", "slipstream.queue.server", "--exit-with-parent", *config_args(cfg)]
    env = None
    if cfg.auth_token not in ("auto", ""):
        env = {**os.environ, TOKEN_ENV: cfg.auth_token}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.1):
                line = proc.stdout.readline()
                if line.startswith(_ANNOUNCE):
                    proc.stdout.close()
                    return QueueServerHandle(proc, line.split()[1])
    proc.kill()
    proc.wait()
    raise RuntimeError(f"queue server did not start within {timeout_s}s (exit code {proc.returncode})")


# ---------------------------------------------------------------------------------------- Ray actor
class QueueServerActor:
    """Host a :class:`QueueServer` in a Ray actor process.

    Example::

        actor = ray.remote(QueueServerActor).options(num_cpus=1).remote(cfg)   # cfg: a QueueConfig
        address = ray.get(actor.address.remote())   # give this to every QueueClient
        ...
        ray.get(actor.stop.remote()); ray.kill(actor)

    The config crosses Ray as the typed ``QueueConfig`` (a msgspec Struct, validated where it was built);
    queue traffic never goes through Ray.
    """

    def __init__(self, cfg: QueueConfig) -> None:
        if not isinstance(cfg, QueueConfig):
            raise TypeError(f"QueueServerActor takes a QueueConfig, not {type(cfg).__name__}")
        self._server = QueueServer(cfg).start()
        freeze_imports()

    def address(self) -> str:
        return self._server.address

    def is_alive(self) -> bool:
        return self._server.is_alive()

    def pid(self) -> int:
        """This process's (the server runs on a thread of it)."""
        return os.getpid()

    def stop(self) -> None:
        self._server.stop()


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """``slipstream queue serve``'s parser: one option per :class:`QueueConfig` field, generated from it
    (``--num-storage-units 4``, ``--capacity-groups 512``; the help is the field's description, a bad value
    is refused naming the key), plus the same keys as positional ``key=value`` overrides."""
    parser = command_parser(
        "slipstream queue serve",
        "Run a TransferQueue server until SIGTERM or SIGINT.",
        usage="slipstream queue serve [--key VALUE ...] [key=value ...]",
    )
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides",
        nargs="*",
        help="the same keys as key=value (or queue.key=value) overrides, e.g. capacity_groups=512; the flags "
        "win over them",
    )
    keys = add_config_options(
        parser, QueueConfig, dashed=True, title="queue config (queue.* in a run's config)"
    )
    return parser, keys


def main(argv: list[str] | None = None) -> int:
    """``slipstream queue serve``: run a server in the foreground until SIGTERM/SIGINT."""
    parser, keys = build_parser()
    args = parser.parse_intermixed_args(argv)
    raw: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"override {item!r}: expected key=value (keys of the `queue` config section)")
        raw[key.removeprefix("queue.")] = override_value(key, value) if value.strip() else ""
    raw.update(config_values(args, keys))
    if "auth_token" not in raw and os.environ.get(TOKEN_ENV):
        raw["auth_token"] = os.environ[TOKEN_ENV]
    try:
        cfg = validate(raw, QueueConfig)
        server = QueueServer(cfg)
    except (ConfigError, ValueError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    freeze_imports()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    parent = os.getppid()
    print(f"{_ANNOUNCE} {server.address}", flush=True)
    sys.stdout = sys.stderr  # the parent reads one line, then stops listening
    server.serve_forever(lambda: stop.is_set() or (args.exit_with_parent and os.getppid() != parent))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # everything is closed; skip the interpreter's teardown of torch (about a second)
