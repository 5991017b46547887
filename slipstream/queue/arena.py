"""Server-owned shared-memory arenas: how same-host payloads skip the socket.

A storage unit owns one arena: a ``memfd`` (anonymous shared memory) of ``shm_bytes_per_unit`` bytes, mapped
with ``MAP_POPULATE`` so every page is faulted in once at start and then reused for the life of the server.
A same-host producer maps it through ``/proc/<server pid>/fd/<fd>``, reserves a region for a group
(controller round trip), copies its tensors straight in and commits; a same-host consumer's lease hands it
views of the same pages. One memcpy per group, end to end, and no page faults on the hot path.

Why memfd rather than ``multiprocessing.shared_memory``: on Python 3.11 every process that attaches to a
``SharedMemory`` registers it with its resource tracker, which unlinks it when that process exits, and a
server killed with SIGKILL leaks a named ``/dev/shm`` file. A memfd has no name to leak: its pages go when
the server process (the last holder of the fd) and the last client mapping go.

Lifetime rule (documented for users in client.py): a region belongs to one group from reserve until that
group is acked (or its reservation expires); views handed to a consumer are valid until it acks or nacks
the lease or the lease's deadline passes. After that the region may hold another group. ``pin``/``unpin``
keep a region from being reused while the server itself still reads it (a snapshot, a socket send).

The allocator is first-fit over a sorted free list with coalescing: allocations are few (one per group in
flight, at most ``capacity_groups``) and freed roughly in FIFO order, so a linear scan is cheap and the
arena does not fragment in practice. No maintained library offers an allocator over a caller's buffer.
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
from typing import Any

import torch

from slipstream.queue.codec import ALIGN

# The head of every arena holds the server's nonce, so a client can tell it opened the right memory.
HEADER_BYTES = 64


def shm_supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class Arena:
    """One unit's shared-memory segment plus its region allocator (used only on the server loop thread)."""

    def __init__(self, size: int, nonce: bytes, name: str = "slipstream-arena") -> None:
        self.size = size
        self._fd = os.memfd_create(name)
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._map[: len(nonce)] = nonce
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.view = torch.frombuffer(self._map, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(HEADER_BYTES, size - HEADER_BYTES)]  # (offset, size), sorted
        self._sizes: dict[int, int] = {}
        self._pins: dict[int, int] = {}
        self._freed_while_pinned: set[int] = set()
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free region of at least ``nbytes`` (64-byte aligned), or None when none fits now."""
        want = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (off, size) in enumerate(self._free):
            if size >= want:
                if size == want:
                    del self._free[i]
                else:
                    self._free[i] = (off + want, size - want)
                self._sizes[off] = want
                self.used += want
                return off
        return None

    def shrink(self, offset: int, nbytes: int) -> None:
        """Give back the tail of a region beyond its first ``nbytes`` (rounded up to 64)."""
        size = self._sizes[offset]
        keep = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if keep >= size:
            return
        self._sizes[offset] = keep
        self.used -= size - keep
        tail = (offset + keep, size - keep)
        i = bisect.bisect_left(self._free, tail)
        self._free.insert(i, tail)
        self._coalesce(i)

    def free(self, offset: int) -> None:
        """Give a region back; deferred while it is pinned."""
        if self._pins.get(offset):
            self._freed_while_pinned.add(offset)
            return
        size = self._sizes.pop(offset)
        self.used -= size
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        self._coalesce(i)

    def pin(self, offset: int) -> None:
        self._pins[offset] = self._pins.get(offset, 0) + 1

    def unpin(self, offset: int) -> None:
        left = self._pins[offset] - 1
        if left:
            self._pins[offset] = left
            return
        del self._pins[offset]
        if offset in self._freed_while_pinned:
            self._freed_while_pinned.discard(offset)
            self.free(offset)

    def reclaim(self, offset: int) -> None:
        """Cancel a free that a pin deferred: the region stays allocated (a journalled group taken back
        by a rollback keeps the region it was consumed from)."""
        self._freed_while_pinned.discard(offset)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.view[offset : offset + nbytes]

    def buffer(self, offset: int, nbytes: int) -> Any:
        """A buffer-protocol view of a region (what ZeroMQ and file writes take); no copy."""
        return self.view[offset : offset + nbytes].numpy()

    def _coalesce(self, i: int) -> None:
        if i + 1 < len(self._free):
            off, size = self._free[i]
            nxt_off, nxt_size = self._free[i + 1]
            if off + size == nxt_off:
                self._free[i] = (off, size + nxt_size)
                del self._free[i + 1]
        if i > 0:
            prev_off, prev_size = self._free[i - 1]
            off, size = self._free[i]
            if prev_off + prev_size == off:
                self._free[i - 1] = (prev_off, prev_size + size)
                del self._free[i]

    def close(self) -> None:
        self.view = torch.empty(0, dtype=torch.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor still views it; the mapping goes with that tensor
        os.close(self._fd)


class ArenaMapping:
    """A client's mapping of a server arena; ``open`` returns None when the arena is not reachable here."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map = mapping
        self._view = memoryview(mapping)

    @classmethod
    def open(cls, path: str, size: int, nonce: bytes) -> ArenaMapping | None:
        if not path or not shm_supported():
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError:
            return None
        finally:
            os.close(fd)
        if mapping[: len(nonce)] != nonce:
            mapping.close()
            return None
        return cls(mapping)

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of a region; tensors built on it keep the mapping alive."""
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view it; the mapping goes with the last of them
