"""The journal: groups consumed since the last committed snapshot, kept so a rolled-back trainer gets them again.

Why it exists: a trainer that crashes while the queue server lives on resumes from its last checkpoint and
restores that checkpoint's queue snapshot. Every group it acked after that snapshot was trained by weights
that are now gone, so those groups must become ready again. So ``ack`` hands each consumed group (header and
payload) to the journal, a successful ``snapshot`` commits (the file records them as consumed and the
journal lets them go), and a ``restore`` of a snapshot this server knows takes them back
(:mod:`slipstream.queue.recovery`).

Why a file, and which one: between two snapshots a trainer may consume many GiB, more than the shared-memory
arena holds, and arena space held by the journal would starve producers. So one writer thread copies each
consumed payload out of its arena region (or its socket frames) into a file, and the region is freed as soon
as that copy is written. The file is anonymous (``O_TMPFILE``, or unlinked right after creation) in
``queue.journal_dir``, by default the system temp dir (``TMPDIR``): nothing to clean up and no name to leak
when the server is killed, no two servers ever share one, and the kernel writes it back and evicts its pages
under memory pressure like any other file. A journal on ``/dev/shm`` stays in RAM instead.

Cost: one copy of every consumed byte, on the writer thread, off every request's path. Fresh file pages are
expensive to fault in (on the benchmark VM a first write into a new file ran at ~5 Gbit/s, a rewrite of
pages the file already had at ~50), so a file whose entries were all committed is reused from offset 0 rather
than dropped: with regular snapshots the journal rewrites pages it already owns. Until its copy is written a
consumed group still counts against the queue's capacity (``backlog_*``), so a journal that falls behind
slows producers down instead of holding ever more memory.

Lifecycle of an entry (all on the server loop thread, except the copy itself)::

    append (on ack; source: the arena region, pinned, or the frames) ──copied──► written (source released)
      │                                                                             │
      ├── commit (a snapshot covering it succeeded): forgotten ◄────────────────────┤
      └── take (a rollback restore): ready again, from its source or an mmap of the file
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from slipstream.queue import protocol as P
from slipstream.queue.arena import Arena
from slipstream.queue.codec import ALIGN, blob_layout, bytes_view, region_extent, spec_nbytes
from slipstream.queue.types import GroupMeta
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

PENDING, WRITTEN, FAILED = 0, 1, 2
# A reused file keeps at most this many bytes of pages; beyond it the tail is truncated (by the writer thread).
KEEP_BYTES = 4 << 30
# Bytes per pwrite: the writer checks between chunks whether the server is stopping.
WRITE_CHUNK = 64 << 20
# Seconds close() waits for the writer to finish the chunk it is writing.
CLOSE_JOIN_S = 5.0


@dataclass(slots=True, eq=False)
class Entry:
    """One consumed group. ``specs`` place its tensors in ``source`` (until written); ``file_specs`` in its
    blob of ``extent`` bytes at ``offset`` in ``file``."""

    index: int
    partition: str
    meta: GroupMeta
    seq: int
    nbytes: int
    dropped: bool
    unit: int
    specs: list[P.TensorSpec]
    file_specs: list[P.TensorSpec]
    extent: int
    source: list[Any] | None
    arena: Arena | None = None  # the source is this arena's region at ``arena_offset`` (pinned until written)
    arena_offset: int = -1
    region_bytes: int = 0
    file: _File | None = None
    offset: int = 0
    state: int = PENDING
    cancelled: bool = False  # committed before its copy ran: the writer skips it
    taken: bool = False  # handed back to the queue by a rollback
    in_backlog: bool = False


class _File:
    """An anonymous journal file. ``live``: entries in it neither committed nor taken; ``pending``: copies
    queued or running; ``mapped``: restored groups view its pages, so it is never written again."""

    def __init__(self, directory: str) -> None:
        self.fd = _anonymous_file(directory)
        self.tail = 0
        self.size = 0
        self.live = 0
        self.pending = 0
        self.mapped = False
        self.idle = False  # closed, or waiting in the spare list


def _anonymous_file(directory: str) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError) as err:
        if isinstance(err, OSError) and err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, path = tempfile.mkstemp(prefix="slipstream-journal-", dir=directory)
    os.unlink(path)  # the open descriptor keeps it; nothing is left behind when the server dies
    return fd


def check_directory(directory: str) -> str:
    """The journal directory to use (``""``: the system temp dir); a clear error when it is unusable."""
    path = directory or tempfile.gettempdir()
    try:
        os.close(_anonymous_file(path))
    except OSError as err:
        raise ValueError(f"queue.journal_dir={path!r} cannot hold the journal: {err}") from None
    return path


class Journal:
    """Entries in ack order plus the files and writer thread behind them. Not thread-safe: only the server
    loop thread calls it; the writer thread only copies bytes and reports back through :attr:`fileno`."""

    def __init__(self, directory: str) -> None:
        self.directory = check_directory(directory)
        self._entries: deque[Entry] = deque()
        self._next_index = 0
        self._current: _File | None = None
        self._spare: list[_File] = []
        self._open: dict[int, _File] = {}  # every file not yet handed to the writer to close, by fd
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: deque[tuple[Entry, OSError | None]] = deque()
        self._unfinished: list[Any] = []  # jobs the writer left when the journal closed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._loop_waiting = True  # the writer wakes the loop only while it waits (see before_wait)
        self._closing = threading.Event()  # set by close(): the writer skips what is left
        self._thread = threading.Thread(target=self._writer, name="queue-journal", daemon=True)
        self._thread.start()
        self.bytes = 0  # payload bytes of the entries held
        self.backlog_groups = 0  # entries whose copy is not written yet (their source is still held)
        self.backlog_bytes = 0

    @property
    def fileno(self) -> int:
        """Readable when copies have finished: :meth:`clear_wakeups`, then :meth:`poll` settles them."""
        return self._wake_r

    def __len__(self) -> int:
        return len(self._entries)

    # ---------------------------------------------------------------------------------------- append
    def append(
        self,
        partition: str,
        meta: GroupMeta,
        seq: int,
        nbytes: int,
        dropped: bool,
        unit: int,
        specs: list[P.TensorSpec],
        source: list[Any],
        arena: Arena | None = None,
        arena_offset: int = -1,
        region_bytes: int = 0,
    ) -> None:
        """Journal a group being consumed; call it before its storage is released (an arena region is
        pinned here, so the release only defers its free until the copy is written)."""
        if arena is not None:
            file_specs, extent = specs, region_bytes  # the region is already one blob laid out by specs
        else:
            file_specs, _ = blob_layout(specs)
            extent = region_extent(file_specs)
        entry = Entry(self._next_index, partition, meta, seq, nbytes, dropped, unit, specs, file_specs, extent,
                      source, arena, arena_offset, region_bytes)  # fmt: skip
        self._next_index += 1
        self._entries.append(entry)
        self.bytes += nbytes
        if extent == 0:  # every tensor is inline in the header: nothing to copy
            entry.state, entry.source = WRITTEN, None
            return
        if arena is not None:
            arena.pin(arena_offset)
        f = self._file()
        entry.file, entry.offset = f, f.tail
        f.tail += -(-extent // ALIGN) * ALIGN
        f.size = max(f.size, f.tail)
        f.live += 1
        f.pending += 1
        entry.in_backlog = True
        self.backlog_groups += 1
        self.backlog_bytes += nbytes
        self._jobs.put(entry)

    def _file(self) -> _File:
        if self._current is None:
            if self._spare:
                self._current = self._spare.pop()
            else:
                self._current = _File(self.directory)
                self._open[self._current.fd] = self._current
            self._current.idle = False
        return self._current

    # ------------------------------------------------------------------------------------ completion
    def before_wait(self) -> bool:
        """Call right before the loop blocks in its poller; False means copies are already done (poll
        without blocking). Together with the writer's check this never loses a wake-up: the writer appends
        its results first and then looks at the flag, the loop sets the flag first and then looks at them."""
        self._loop_waiting = True
        return not self._done

    def after_wait(self) -> None:
        self._loop_waiting = False

    def clear_wakeups(self) -> None:
        """Empty the wake-up pipe (call it when :attr:`fileno` polls readable; :meth:`poll` does the rest)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def poll(self) -> int:
        """Settle finished copies (release sources, unpin regions, reuse idle files); returns how many
        left the backlog, so the caller can admit puts waiting on capacity."""
        settled = 0
        while self._done:
            entry, error = self._done.popleft()
            settled += self._settle(entry, error)
        return settled

    def _settle(self, entry: Entry, error: OSError | None) -> int:
        f = entry.file
        assert f is not None
        f.pending -= 1
        left = self._leave_backlog(entry)
        if error is not None and entry.state == PENDING and not (entry.cancelled or entry.taken):
            # Nothing may be lost: keep the source (and its region) until a snapshot covers the group.
            entry.state = FAILED
            log.error(
                "journal: could not write group %r (%s); keeping it in memory", entry.meta.group_id, error
            )
        else:
            if entry.state == PENDING and error is None:
                entry.state = WRITTEN
            if not entry.taken:
                entry.source = None
            self._unpin(entry)
        self._maybe_idle(f)
        return left

    def _leave_backlog(self, entry: Entry) -> int:
        if not entry.in_backlog:
            return 0
        entry.in_backlog = False
        self.backlog_groups -= 1
        self.backlog_bytes -= entry.nbytes
        return 1

    @staticmethod
    def _unpin(entry: Entry) -> None:
        if entry.arena is not None:
            entry.arena.unpin(entry.arena_offset)
            entry.arena = None

    def _maybe_idle(self, f: _File) -> None:
        """A file with nothing live or in flight: reuse it (its pages kept) or, if restored groups map it or
        a spare exists, close it. Closing and truncating run on the writer thread, after its queued copies
        (dropping a large file's pages takes a while)."""
        if f is self._current or f.live or f.pending or f.idle:
            return
        if f.mapped or self._spare:
            f.idle = True
            del self._open[f.fd]
            self._jobs.put(("close", f.fd))
            return
        f.tail = 0
        if f.size > KEEP_BYTES:
            f.size = KEEP_BYTES
            self._jobs.put(("truncate", f.fd, KEEP_BYTES))
        f.idle = True
        self._spare.append(f)

    # ---------------------------------------------------------------------------------- commit, take
    def seal(self) -> int:
        """Mark the point a snapshot is taken at (its :meth:`commit` forgets the entries before it); later
        entries go to another file, so the sealed one can be reused once committed."""
        if self._current is not None and self._current.live:
            self._current = None
        return self._next_index

    def commit(self, mark: int) -> None:
        """Forget the entries appended before ``mark`` (a snapshot that covers them is safely written)."""
        while self._entries and self._entries[0].index < mark:
            entry = self._entries.popleft()
            self.bytes -= entry.nbytes
            entry.cancelled = True  # a copy still queued is skipped; its completion unpins the region
            if entry.state == FAILED:
                entry.source = None
                self._unpin(entry)
            if entry.file is not None:
                entry.file.live -= 1
                self._maybe_idle(entry.file)

    def take_all(self) -> list[Entry]:
        """Remove every entry (a rollback makes them ready again) and hand each back with ``source`` set:
        its original buffers while its copy is not written (``arena_offset >= 0``: the arena region, whose
        deferred free is cancelled; the pin goes when the copy reports back), else a read-only view of its
        blob in the file (``specs`` is then ``file_specs`` and ``arena_offset`` -1)."""
        entries = list(self._entries)
        self._entries.clear()
        self.bytes = 0
        current, self._current = self._current, None  # its blobs may be mapped now: never written again
        if current is not None:
            self._maybe_idle(current)
        for entry in entries:
            entry.taken = True
            f = entry.file
            if entry.state == WRITTEN:
                entry.arena_offset = -1
                if f is not None:
                    entry.source = [self._map(f, entry.offset, entry.extent)]
                    entry.specs = entry.file_specs
                    f.mapped = True
            else:
                self._leave_backlog(entry)
                if entry.arena is not None:
                    entry.arena.reclaim(entry.arena_offset)
                    if entry.state == FAILED:
                        self._unpin(entry)
            if f is not None:
                f.live -= 1
                self._maybe_idle(f)
        return entries

    @staticmethod
    def _map(f: _File, offset: int, extent: int) -> memoryview:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(f.fd, offset - start + extent, prot=mmap.PROT_READ, offset=start)
        return memoryview(mapping)[offset - start : offset - start + extent]

    # ------------------------------------------------------------------------------------ the writer
    def _writer(self) -> None:
        while True:
            job = self._jobs.get()
            batch = [job]
            while True:  # everything queued now, then one wake-up for all of it
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for job in batch:
                if job is None or self._closing.is_set():
                    self._unfinished.extend(j for j in batch[batch.index(job) :] if j is not None)
                    return
                if isinstance(job, tuple):
                    _file_op(*job)
                    continue
                try:
                    error = None if job.cancelled else _copy(job, self._closing)
                except OSError as err:
                    error = err
                self._done.append((job, error))
            if self._loop_waiting:  # a busy loop settles them on its next tick without a wake-up
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    return  # closed under us: the server is stopping

    def close(self) -> None:
        """Stop the writer and let the files go, in bounded time whatever they hold.

        Copies still queued are skipped (the journal dies with the server: nothing reads it again), and the
        chunk being written is the last. The files are not closed here: dropping the last reference to a file
        of many GiB makes the kernel free its pages and blocks (on ext4 with online discard, a synchronous
        discard of every block) in the closing process, uninterruptibly: 2 s for 8 GiB on the project VM, and
        long enough with the benchmark's ~20 GiB that even SIGKILL did not end the server within 10 s. A
        reaper process inherits them instead and closes them once this process has let go of its own copies
        (:func:`_release_elsewhere`), so the server's exit never waits for the kernel's clean-up."""
        self._closing.set()
        self._jobs.put(None)
        self._thread.join(timeout=CLOSE_JOIN_S)
        if self._thread.is_alive():
            log.warning("journal: the writer did not stop within %.0f s; leaving it", CLOSE_JOIN_S)
        while True:  # file closes the writer had not run yet
            try:
                self._unfinished.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        fds = list(self._open) + [j[1] for j in self._unfinished if isinstance(j, tuple) and j[0] == "close"]
        self._open.clear()
        _release_elsewhere(fds)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _release_elsewhere(fds: list[int]) -> None:
    """Close ``fds`` here, after handing them to a reaper process that closes them last (see
    :meth:`Journal.close`); closes them here directly when no reaper can start."""
    if not fds:
        return
    reaper = None
    try:  # the reaper reads its stdin to EOF (this process closing the pipe), then exits, closing the files
        reaper = subprocess.Popen(
            [sys.executable, "-S", "-c", "import sys; sys.stdin.buffer.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=fds, start_new_session=True, close_fds=True,
        )  # fmt: skip
    except OSError as err:
        log.warning("journal: no reaper process (%s); closing the journal files in the server", err)
    for fd in fds:
        _file_op("close", fd)
    if reaper is not None and reaper.stdin is not None:
        reaper.stdin.close()


def _copy(entry: Entry, stop: threading.Event) -> None:
    """Write an entry's blob (runs on the writer thread; ``os.pwrite`` releases the GIL); gives up between
    chunks once ``stop`` is set (the server is stopping)."""
    fd, base, source = entry.file.fd, entry.offset, entry.source
    if entry.specs is entry.file_specs:
        _pwrite_all(fd, bytes_view(source[0])[: entry.extent], base, stop)
        return
    for old, new in zip(entry.specs, entry.file_specs, strict=True):
        if old.frame >= 0:
            n = spec_nbytes(old)
            view = bytes_view(source[old.frame])[old.offset : old.offset + n]
            _pwrite_all(fd, view, base + new.offset, stop)


def _pwrite_all(fd: int, view: memoryview, offset: int, stop: threading.Event) -> None:
    while len(view) and not stop.is_set():
        n = os.pwrite(fd, view[:WRITE_CHUNK], offset)
        view, offset = view[n:], offset + n


def _file_op(op: str, fd: int, *args: int) -> None:
    try:
        if op == "truncate":
            os.ftruncate(fd, *args)
        else:
            os.close(fd)
    except OSError as err:
        log.warning("journal: %s of a journal file failed: %s", op, err)
