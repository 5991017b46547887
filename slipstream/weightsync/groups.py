"""Process groups between independent processes: the trainer's sending rank and the servers' workers.

``torch.distributed.init_process_group`` makes *the* default group of a process, and ``new_group`` is a
collective over that default group, so neither can join a trainer rank with inference servers that were
started on their own (a server never shares our default group). The recipe that works, and the one SGLang
uses on its side (``init_custom_process_group``), is: a ``TCPStore`` hosted by rank 0, a
``PrefixStore(group_name)`` over it, then torch's ``_new_process_group_helper`` with no global ranks, and the
group registered in ``_world`` so that ``destroy_process_group`` cleans it up. We follow it step for step
because the store keys must match byte for byte when a real SGLang server joins our group over NCCL; the
same code builds a gloo group on CPU. The helper is private torch API: :func:`open_group` is the only
caller, and tests/weightsync exercise it on every torch we support.

Two deviations, both about where sockets listen: rank 0's store listens on a socket we bind ourselves to
``master_address`` (loopback by default; torch's own store would listen on every interface), and gloo's
data sockets are pinned to the loopback interface when the master address is loopback.

Joining (rank > 0) gives up within ``timeout_s`` when nobody answers at the master's address: a dead
port, or a listener that is not a store (see ``_wait_listening`` and ``_before``).

Failure behaviour (measured on gloo, torch 2.13): a receiver that dies makes the sender's pending
broadcast fail at once ("Connection closed by peer"); a sender that dies leaves receivers waiting until
the group timeout. So every group gets ``timeout_s``, and after any failure it is closed without a barrier.

Worked example (rank 0 in the trainer, rank 1 in a server process)::

    sock = reserve_port("127.0.0.1")                       # rank 0 only
    g = open_group(master_address="127.0.0.1", master_port=sock.getsockname()[1], rank=0, world_size=2,
                   group_name="w", backend="gloo", timeout_s=60, listen_socket=sock)
    g.broadcast(torch.arange(4.0), timeout_s=60)           # rank 1 passes an empty tensor to fill
    g.close()
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from slipstream.utils.logging import get_logger
from slipstream.utils.net import is_loopback
from slipstream.weightsync.errors import TransferError

log = get_logger(__name__)

_ENV_LOCK = threading.Lock()
BACKENDS = ("gloo", "nccl")


def reserve_port(address: str, port: int = 0) -> socket.socket:
    """A listening socket bound to ``address`` for rank 0's store (port 0 picks a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    return sock


def backend_for_device(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for_backend(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class DistGroup:
    """One torch.distributed group of ``world_size`` ranks; rank 0 is the sender.

    Calls go to the group object directly (``pg.broadcast``), never through the functional API, so the
    code does not depend on how the group is registered. After a failed wait the group is unusable:
    close it and build a new one.
    """

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    group_name: str
    device: torch.device
    store: dist.Store | None = None
    broken: bool = False
    _closed: bool = field(default=False, repr=False)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0 (receivers pass the tensor to fill)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            return self.pg.broadcast([tensor], opts)
        except RuntimeError as err:
            self.broken = True
            raise TransferError(f"group `{self.group_name}`: broadcast failed to start: {err}") from err

    def wait(self, work: dist.Work, timeout_s: float) -> None:
        """Wait for ``work``; TransferError (and the group marked broken) on failure or timeout."""
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as err:
            self.broken = True
            raise TransferError(f"group `{self.group_name}` (rank {self.rank}): {_short(err)}") from err
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        self.wait(self.broadcast_async(tensor), timeout_s)

    def close(self, barrier_timeout_s: float = 10.0) -> None:
        """Leave the group. A healthy group first meets its peers at a barrier so nobody exits mid-way."""
        if self._closed:
            return
        self._closed = True
        if not self.broken and barrier_timeout_s > 0:
            try:
                self.pg.barrier().wait(timedelta(seconds=barrier_timeout_s))
            except RuntimeError as err:
                log.debug("group %s: barrier before close failed: %s", self.group_name, _short(err))
        try:
            dist.destroy_process_group(self.pg)
        except Exception as err:  # a half-built or already-torn group: nothing left to release
            log.debug("group %s: destroy failed: %s", self.group_name, _short(err))
        self.store = None


def open_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    listen_socket: socket.socket | None = None,
) -> DistGroup:
    """Join (rank > 0) or host (rank 0) a group; returns once all ``world_size`` ranks have joined.

    Raises TransferError when the peers do not all arrive within ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown process-group backend `{backend}` (expected one of {', '.join(BACKENDS)})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend `nccl` needs a CUDA GPU; use `gloo` on CPU")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0 and listen_socket is None:
        listen_socket = reserve_port(master_address, master_port)
    try:
        store = _store(master_address, master_port, rank, world_size, timeout, listen_socket)
        pg = _new_group(store, rank, world_size, group_name, backend, timeout, is_loopback(master_address))
    except (RuntimeError, ValueError, OSError) as err:
        if listen_socket is not None and listen_socket.fileno() >= 0:
            listen_socket.close()
        raise TransferError(
            f"could not build group `{group_name}` (rank {rank}/{world_size}): {_short(err)}"
        ) from err
    return DistGroup(
        pg=pg,
        rank=rank,
        world_size=world_size,
        backend=backend,
        group_name=group_name,
        device=device_for_backend(backend),
        store=store,
    )


def _store(
    address: str, port: int, rank: int, world_size: int, timeout: timedelta, sock: socket.socket | None
) -> dist.Store:
    if rank == 0:
        assert sock is not None
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the listening socket from here on and closes it when freed
        try:
            return dist.TCPStore(
                address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=fd
            )
        except BaseException:
            os.close(fd)
            raise
    deadline = time.monotonic() + timeout.total_seconds()
    _wait_listening(address, port, deadline)
    remaining = timedelta(seconds=max(0.1, deadline - time.monotonic()))
    return _before(
        deadline, lambda: dist.TCPStore(address, port, world_size, False, remaining), address, port
    )


def _wait_listening(address: str, port: int, deadline: float) -> None:
    """Return once ``address:port`` accepts a connection; TimeoutError at ``deadline``.

    Why not leave it to TCPStore: its client tries for the whole timeout, then retries once more after a
    back-off, so a dead master port held a 20 s init for 43 s. Probing ourselves keeps the deadline; by the
    time the store connects, the port answers and its retry path is not taken.
    """
    pause = 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing listens on {address}:{port} (the group's master)")
        try:
            socket.create_connection((address, port), timeout=min(left, 5.0)).close()
            return
        except OSError:
            threading.Event().wait(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, 1.0)


def _before(deadline: float, build, address: str, port: int):
    """``build()`` in a helper thread, given up on at ``deadline``.

    A listener that accepts but never speaks the store protocol leaves TCPStore's handshake waiting with no
    timeout at all; the helper thread then stays blocked until that peer closes, but the caller is free.
    """
    result: dict = {}

    def run() -> None:
        try:
            result["store"] = build()
        except BaseException as err:  # handed to the caller below
            result["error"] = err

    thread = threading.Thread(target=run, name="slipstream-store-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if "error" in result:
        raise result["error"]
    if "store" not in result:
        raise TimeoutError(f"{address}:{port} accepted a connection but did not answer as a TCPStore")
    return result["store"]


def _new_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: timedelta,
    loopback: bool,
) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    prefixed = PrefixStore(group_name, store)
    with _gloo_interface("lo" if loopback and backend == "gloo" else None):
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=timeout
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class _gloo_interface:
    """Pin gloo's sockets to one interface while a group is built (gloo reads GLOO_SOCKET_IFNAME then).

    The environment is process-wide, so the change is held under a lock and undone at once; a value the
    user set is left alone.
    """

    def __init__(self, ifname: str | None) -> None:
        names = {name for _, name in socket.if_nameindex()}
        self.ifname = ifname if ifname in names and "GLOO_SOCKET_IFNAME" not in os.environ else None

    def __enter__(self) -> None:
        if self.ifname:
            _ENV_LOCK.acquire()
            os.environ["GLOO_SOCKET_IFNAME"] = self.ifname

    def __exit__(self, *exc: object) -> None:
        if self.ifname:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
            _ENV_LOCK.release()


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:300]
