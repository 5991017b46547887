"""The server's snapshot directory: the only place a snapshot is written to or restored from.

Why: SNAPSHOT and RESTORE come from the wire, so their target must not be a path the requester chooses (a
relative ``../..``, an absolute path, a symbolic link planted in the directory, or a FIFO whose open never
returns). A request carries a *name* instead, resolved inside ``queue.snapshot_dir``:

* a name is 1 to ``MAX_PARTS`` parts joined by ``/`` (so a checkpoint can hold its snapshot, e.g.
  ``step_00000010/queue``); each part is letters, digits, ``_``, ``-``, ``.``, and never ``.`` or ``..``;
* every directory on the way is opened with ``O_NOFOLLOW`` relative to the one before (``openat``), so a
  symbolic link anywhere inside the directory is refused rather than followed out of it;
* a snapshot is written to a fresh temporary name (``O_EXCL``) beside its target, then renamed over it; the
  temporary file is removed whatever fails. It only replaces a regular file that already is a snapshot
  (starts with the format's magic bytes), never anything else;
* a restore opens the file with ``O_NONBLOCK`` and checks it is a regular file before reading a byte, so a
  FIFO or device is refused at once instead of blocking the server's IO thread.

Example: with ``snapshot_dir=/runs/r1/checkpoints``, ``client.snapshot("step_00000010/queue")`` writes
``/runs/r1/checkpoints/step_00000010/queue``; ``"../x"``, ``"/etc/passwd"`` and ``"a//b"`` are refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from slipstream.queue.codec import WireError

MAX_PARTS = 8
_PART = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_name(name: str) -> list[str]:
    """The parts of a valid snapshot name; WireError (``bad_request``) naming the rule otherwise."""
    parts = name.split("/")
    if len(parts) <= MAX_PARTS and all(_PART.match(p) and p not in (".", "..") for p in parts):
        return parts
    raise WireError(
        "bad_request",
        f"snapshot name {name[:200]!r}: a name inside the server's snapshot_dir, not a path: 1-{MAX_PARTS} "
        "parts joined by '/', each of letters, digits, '_', '-', '.' (not '.' or '..')",
    )


class SnapshotDir:
    """Files under one directory, reached only by names (see the module docstring)."""

    def __init__(self, root: str, magic: bytes) -> None:
        self.root = os.path.abspath(root)
        self._magic = magic

    # ----------------------------------------------------------------------------------- directories
    @contextlib.contextmanager
    def _parent(self, name: str, create: bool) -> Iterator[tuple[int, str]]:
        """The open directory holding ``name``'s last part, and that part."""
        parts = check_name(name)
        if create:
            _os_call(name, os.makedirs, self.root, exist_ok=True)
        fd = _open_dir(self.root, None, name)
        try:
            for part in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                child = _open_dir(part, fd, name)
                os.close(fd)
                fd = child
            yield fd, parts[-1]
        finally:
            os.close(fd)

    # ----------------------------------------------------------------------------------------- write
    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> None:
        """Write ``name`` through ``fill(file)`` via a temporary file renamed into place (removed on any
        failure); refuse to replace anything but an earlier snapshot."""
        with self._parent(name, create=True) as (dir_fd, leaf):
            self._check_replaceable(dir_fd, leaf, name)
            tmp = f".{leaf}.{secrets.token_hex(6)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = _os_call(name, os.open, tmp, flags, 0o644, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    fill(f)
                    f.flush()
                    os.fsync(f.fileno())
                self._check_replaceable(dir_fd, leaf, name)
                os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.fsync(dir_fd)  # the rename itself reaches the disk

    def _check_replaceable(self, dir_fd: int, leaf: str, name: str) -> None:
        try:
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and self._starts_with_magic(dir_fd, leaf):
            return
        raise WireError(
            "bad_request", f"snapshot {name!r} exists and is not a queue snapshot; refusing to replace it"
        )

    def _starts_with_magic(self, dir_fd: int, leaf: str) -> bool:
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(self._magic)) == self._magic
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ read
    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        """``name`` opened for reading; WireError unless it is a regular file inside the directory."""
        with self._parent(name, create=False) as (dir_fd, leaf):
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = _os_call(name, os.open, leaf, flags, dir_fd=dir_fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise WireError("bad_request", f"snapshot {name!r} is not a regular file")
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb") as f:
                yield f


def _open_dir(path: str, dir_fd: int | None, name: str) -> int:
    return _os_call(name, os.open, path, _DIR_FLAGS, dir_fd=dir_fd)


def _os_call(name: str, fn: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """``fn(*args)``, its OSError turned into a WireError that names the snapshot, not server paths."""
    try:
        return fn(*args, **kwargs)
    except FileNotFoundError:
        raise WireError("bad_request", f"no snapshot {name!r} in the server's snapshot_dir") from None
    except OSError as err:
        link = err.errno in (errno.ELOOP, errno.ENOTDIR)
        why = "a symbolic link or not a directory" if link else err.strerror
        raise WireError("bad_request", f"snapshot {name!r}: {why}") from None
