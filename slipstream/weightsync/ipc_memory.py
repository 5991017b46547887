"""The two memory kinds the ``ipc`` transport shares between processes, and how it tells whether two processes
can share them (``weightsync/ipc_engine.py`` has the protocol).

* :class:`HostMemory`: POSIX shared memory through torch's file-descriptor sharing; the descriptor travels as
  SCM_RIGHTS data on the transport's control socket.
* :class:`CudaMemory`: GPU memory shared by CUDA IPC handle, the fields of ``UntypedStorage._share_cuda_()``
  in a msgspec struct (the calls ``torch.multiprocessing`` makes, without its pickling).

:func:`colocated` compares two rendezvous: one host (:func:`host_identity`: host name and boot id) and, for a
GPU sender, one physical GPU (:func:`device_identity`: its UUID, since CUDA_VISIBLE_DEVICES numbers devices
differently in each process).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import IpcBuffer, Rendezvous

# ------------------------------------------------------------------------------------------- identities


def host_identity() -> str:
    """This machine: host name and boot id (two containers of one host with their own names differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_identity(device: torch.device) -> str:
    """``cpu``, or ``cuda:<UUID>`` of the physical GPU behind ``device`` in this process."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def colocated(sender: Rendezvous, receiver: Rendezvous) -> bool:
    """Whether ``ipc`` can join the two: one host, and for a GPU sender the receiver on the same GPU.

    A host-memory sender serves any receiver of its host (the receiver copies into its own device).
    """
    if not sender.host or sender.host != receiver.host:
        return False
    return sender.device == "cpu" or sender.device == receiver.device


def _local_cuda_index(identity: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_identity(torch.device("cuda", index)) == identity:
            return index
    raise TransferError(f"the sender's GPU ({identity}) is not visible in this process")


# ---------------------------------------------------------------------------------------- memory kinds


class HostMemory:
    """Buffers in POSIX shared memory, shared by file descriptor (module docstring)."""

    kind = "cpu"

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        storage = torch.UntypedStorage._new_using_fd_cpu(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage).zero_()  # pages committed now, not mid-push

    def share(self, buf: torch.Tensor) -> tuple[IpcBuffer, int | None]:
        fd, size = buf.untyped_storage()._share_fd_cpu_()
        return IpcBuffer(nbytes=size), fd

    def open(self, desc: IpcBuffer, fd: int | None) -> torch.Tensor:
        if fd is None:
            raise TransferError("a host-memory buffer arrived without its file descriptor")
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, desc.nbytes)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def published(self, device: torch.device) -> None:
        """The packing copies have finished when the packer returns (CPU copies are synchronous)."""

    def copied(self, device: torch.device) -> None:
        """Likewise for the receiver's copy."""


class CudaMemory:
    """Buffers in GPU memory, shared by CUDA IPC handle (module docstring)."""

    kind = "cuda"

    def __init__(self, identity: str = "") -> None:
        self.identity = identity  # receiver side: the sender's GPU, found here by UUID

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def share(self, buf: torch.Tensor) -> tuple[IpcBuffer, int | None]:
        # Field order of torch/multiprocessing/reductions.py (reduce_tensor / rebuild_cuda_tensor).
        (device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync) = (
            buf.untyped_storage()._share_cuda_()
        )
        desc = IpcBuffer(
            nbytes=size,
            device=device,
            handle=handle,
            offset=offset,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=event_handle,
            event_sync_required=bool(event_sync),
        )
        return desc, None

    def open(self, desc: IpcBuffer, fd: int | None) -> torch.Tensor:
        index = _local_cuda_index(self.identity)
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            desc.handle,
            desc.nbytes,
            desc.offset,
            desc.ref_counter_handle,
            desc.ref_counter_offset,
            desc.event_handle,
            desc.event_sync_required,
        )
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)

    def published(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

    def copied(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        else:
            torch.cuda.synchronize()


def memory_for(identity: str) -> HostMemory | CudaMemory:
    return HostMemory() if identity == "cpu" else CudaMemory(identity)


def shm_room() -> int | None:
    """Free bytes in /dev/shm (None where there is none to ask): a container's is often 64 MiB."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
