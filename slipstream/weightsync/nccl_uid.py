"""``nccl_uid``: the sending end of vLLM's own ``nccl`` weight-transfer engine (GPU only).

vLLM 0.33's torch-free rendezvous: we mint an NCCL unique id (``prepare``), every vLLM worker gets it in
``/init_weight_transfer_engine {init_info: {nccl_unique_id_b64, rank_offset, world_size, packed...}}`` and
runs ``ncclCommInitRank``; after it both sides run a one-element all-reduce (vLLM's warm-up handshake)
before any broadcast. Each bucket is one broadcast whose metadata the caller announces out of band (the
server's blocking ``/update_weights {update_info}`` call), in vLLM's packed layout. The receiving end is
vLLM's engine, not ours, so this transport has no receiving side.

A peer that dies mid-broadcast leaves the NCCL kernel spinning: each broadcast runs on a stream of its own
and is waited for up to ``timeout_s``; past that, or on any failure, the communicator is aborted
(:func:`abort_comm`) so the GPU and the trainer's streams are free again.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Awaitable

import torch

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import TRANSPORTS, Transport, WeightStream
from slipstream.weightsync.buckets import BufferPool, PackedBucket
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import InitInfo, Rendezvous

log = get_logger(__name__)


@TRANSPORTS.register("nccl_uid")
class NcclUidTransport(Transport):
    """Rank 0 of an NCCL communicator built from a unique id (module docstring)."""

    depth = 1

    def __init__(self, cfg, *, is_sender: bool, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, is_sender=is_sender, device=device)
        if not is_sender:
            raise ValueError("`nccl_uid` has no receiving end here: vLLM's `nccl` engine receives")
        self.comm = None
        self.group_name = ""
        self.stream = None
        self._uid = b""
        self.pool = BufferPool(self.device)

    def prepare(self) -> Rendezvous:
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise TransferError("vLLM weight sync runs over NCCL and needs a GPU on the trainer side")
        import torch.cuda.nccl as nccl

        self._uid = nccl.unique_id()
        return Rendezvous(backend=self.name, nccl_unique_id=self._uid)

    def connect(self, info: InitInfo) -> None:
        import torch.cuda.nccl as nccl

        if info.rank != 0 or not self._uid:
            raise ValueError("call prepare() on the sender (rank 0) before connect()")
        torch.cuda.set_device(self.device)
        comm = nccl.init_rank(info.world_size, self._uid, 0)
        try:
            probe = torch.zeros(1, device=self.device)
            nccl.all_reduce([probe], comms=[comm])  # vLLM's warm-up handshake, before any broadcast
            torch.cuda.synchronize(self.device)
        except BaseException:
            abort_comm(comm)  # a half-built communicator: its peers may never arrive
            raise
        self.comm, self.group_name = comm, info.group_name
        self.stream = torch.cuda.Stream(self.device)

    def start_bucket(self, bucket: PackedBucket) -> Awaitable[None]:
        raise TransferError("`nccl_uid` needs each bucket announced to vLLM: send with `announce`")

    def send_payload(self, bucket: PackedBucket) -> None:
        import torch.cuda.nccl as nccl

        if self.comm is None:
            raise TransferError(f"group `{self.group_name}`: the communicator was torn down")
        torch.cuda.set_device(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the bucket was packed there
        nccl.broadcast([bucket.data], root=0, streams=[self.stream], comms=[self.comm])
        done = torch.cuda.Event()
        done.record(self.stream)
        if not wait_done(done.query, self.cfg.timeout_s):
            self.fail()
            raise TransferError(
                f"group `{self.group_name}`: a broadcast did not complete within {self.cfg.timeout_s:g} s "
                "(a server died or stopped receiving); communicator aborted"
            )

    def receive_weights(self) -> WeightStream:
        raise TransferError("`nccl_uid` has no receiving end here: vLLM's `nccl` engine receives")

    def fail(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            abort_comm(comm)

    def close(self) -> None:
        self.comm = None  # torch destroys a communicator when its last reference goes


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
