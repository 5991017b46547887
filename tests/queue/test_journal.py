"""The journal on its own: copies reach the file and free their source, commits forget, takes give back, files
are reused, and an unusable directory is a clear error."""

from __future__ import annotations

import select
import time

import pytest
import torch

from slipstream.queue import protocol as P
from slipstream.queue.arena import HEADER_BYTES, Arena, shm_supported
from slipstream.queue.codec import DTYPE_NAMES, as_buffer, layout_region, unpack, write_region
from slipstream.queue.journal import PENDING, WRITTEN, Journal
from slipstream.queue.testing import make_group


def _settle(journal: Journal) -> None:
    """Wait (on the journal's wake-up descriptor, as the server loop does) until no copy is outstanding."""
    deadline = time.monotonic() + 30
    while journal.backlog_groups:
        assert time.monotonic() < deadline, "journal copies never finished"
        if select.select([journal.fileno], [], [], 1.0)[0]:
            journal.clear_wakeups()
        journal.poll()


def _append_frames(journal: Journal, gid: str, seq: int, payload: int = 300):
    """Journal a group as a socket put stores it: one frame per tensor."""
    group = make_group(gid, payload=payload)
    specs, frames = [], []
    for name, t in group.tensors.items():
        specs.append(P.TensorSpec(name, DTYPE_NAMES[t.dtype], list(t.shape), frame=len(frames)))
        frames.append(bytearray(t.contiguous().view(torch.uint8).numpy().tobytes()))
    journal.append("train", group.meta, seq, group.nbytes, False, 0, specs, frames)
    return group


def _same(specs, buffers, group) -> bool:
    got = unpack(specs, [as_buffer(b) for b in buffers])
    return all(torch.equal(got[name], t) for name, t in group.tensors.items())


def test_copies_are_written_committed_and_taken_back(tmp_path):
    journal = Journal(str(tmp_path))
    try:
        groups = [_append_frames(journal, f"g{i}", i) for i in range(3)]
        assert len(journal) == 3 and journal.bytes == sum(g.nbytes for g in groups)
        _settle(journal)
        mark = journal.seal()  # a snapshot starts here
        later = _append_frames(journal, "g3", 3)
        journal.commit(mark)  # ... and succeeded: the three before it are forgotten
        assert len(journal) == 1 and journal.bytes == later.nbytes
        _settle(journal)
        (entry,) = journal.take_all()
        assert entry.state == WRITTEN and entry.meta == later.meta and entry.seq == 3
        assert _same(entry.specs, entry.source, later)  # read back from the file, through an mmap
        assert len(journal) == 0 and journal.bytes == 0
    finally:
        journal.close()


def test_a_committed_file_is_reused_from_its_start(tmp_path):
    journal = Journal(str(tmp_path))
    try:
        _append_frames(journal, "a", 0)
        first = journal._current
        _settle(journal)
        journal.commit(journal.seal())
        _settle(journal)
        _append_frames(journal, "b", 1)
        assert journal._current is first and journal._entries[0].offset == 0  # pages it already has
        _settle(journal)
    finally:
        journal.close()


@pytest.mark.skipif(not shm_supported(), reason="needs Linux memfd")
def test_an_arena_region_is_freed_once_written_and_kept_when_taken_back_first(tmp_path):
    arena = Arena(HEADER_BYTES + (1 << 20), b"n" * 16)
    journal = Journal(str(tmp_path))
    try:

        def journal_region(gid: str, seq: int):
            group = make_group(gid, payload=1000)
            specs, size = layout_region(group.tensors, 0)
            offset = arena.alloc(size)
            write_region(arena.buffer(offset, size), group.tensors, specs)
            journal.append("train", group.meta, seq, group.nbytes, False, 0, specs,
                           [arena.buffer(offset, size)], arena, offset, size)  # fmt: skip
            arena.free(offset)  # the group's release: deferred while the copy is pending
            return group, offset, size

        journal_region("a", 0)
        _settle(journal)
        assert arena.used == 0  # written: the region went back to the arena
        journal.commit(journal.seal())

        group, offset, size = journal_region("b", 1)
        (entry,) = journal.take_all()  # before its copy reports back
        if entry.state == PENDING:  # the usual case: served from the region it was consumed from
            assert entry.arena_offset == offset and arena.used >= size
            assert _same(entry.specs, [arena.buffer(offset, size)], group)
            _settle_taken(journal)
            assert arena.used >= size  # still the restored group's
            arena.free(offset)
        else:  # the copy already finished: the file serves it
            assert _same(entry.specs, entry.source, group)
        assert arena.used == 0
    finally:
        journal.close()
        arena.close()


def _settle_taken(journal: Journal) -> None:
    deadline = time.monotonic() + 30
    while any(f.pending for f in journal._open.values()):
        assert time.monotonic() < deadline
        if select.select([journal.fileno], [], [], 1.0)[0]:
            journal.clear_wakeups()
        journal.poll()


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="journal_dir=.*cannot hold the journal"):
        Journal(str(tmp_path / "missing"))


def test_close_skips_queued_copies_and_hands_the_files_to_a_reaper(tmp_path, monkeypatch):
    """A stopping server does not copy what it journalled but has not written yet (the journal dies with it),
    and never drops the last reference to a journal file itself: freeing a file of many GiB blocks the
    closing process in the kernel, past SIGKILL (the `bench queue` crash)."""
    import os
    import threading

    from slipstream.queue import journal as J

    first_write, release = threading.Event(), threading.Event()
    written: list[int] = []
    real_pwrite, real_release = os.pwrite, J._release_elsewhere

    def slow_disk(fd, data, offset):  # the first write waits until close() has begun
        first_write.set()
        release.wait(30)
        written.append(len(data))
        return real_pwrite(fd, data, offset)

    handed: list[list[int]] = []

    def release_elsewhere(fds):
        handed.append([os.fstat(fd).st_ino for fd in fds])
        real_release(fds)

    monkeypatch.setattr(J.os, "pwrite", slow_disk)
    monkeypatch.setattr(J, "_release_elsewhere", release_elsewhere)
    journal = Journal(str(tmp_path))
    payload = 1 << 20  # bytes per response token: 8 MiB per group
    groups = [_append_frames(journal, f"big{i}", i, payload=payload) for i in range(6)]
    assert first_write.wait(30)
    inode = os.fstat(journal._current.fd).st_ino
    closer = threading.Thread(target=journal.close)
    closer.start()
    assert journal._closing.wait(30)
    release.set()
    closer.join(60)
    assert not closer.is_alive() and not journal._thread.is_alive()
    total = sum(g.nbytes for g in groups)
    assert sum(written) <= groups[0].nbytes < total  # at most the group being written when close began
    assert handed == [[inode]]
