"""The snapshot file: everything unconsumed or leased, the consumed set and the dropped list, in one file.

Saved next to trainer checkpoints so a restarted run neither loses nor re-trains a group. The format is our
own wire vocabulary on disk, never pickle or ``torch.save`` (a snapshot may be read by a newer server)::

    b"SLIPSTQ1" | u64 little-endian header length | msgpack SnapshotHeader | zero padding to 64 bytes
    | payload: each group's non-inline tensors in one 64-byte aligned blob, groups one after another

Each :class:`SnapGroup` says where its blob starts in the payload section and where each tensor sits in its
blob, exactly like an arena region (``TensorSpec.frame == 0``). Files live in the server's snapshot directory
and are reached by name only (:mod:`slipstream.queue.snapdir`): written to a temporary name and renamed, so
a crash mid-write leaves the previous snapshot intact and no temporary file behind a failed write.

Older formats still load, upgraded as they are read (:func:`decode_header`): format 1 gave each group header
a free-form ``extra`` map where format 2 has a typed ``Provenance`` (read through :class:`LegacyGroupMeta`).
Sample headers need no such path: the slot of their retired ``extra`` map decodes into ``SampleOutcome``
(``queue/types.py``).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

import msgspec

from slipstream.queue import protocol as P
from slipstream.queue.codec import ALIGN, WireError, blob_layout, bytes_view, spec_nbytes, validate_group
from slipstream.queue.snapdir import SnapshotDir
from slipstream.queue.types import GroupMeta, Provenance, SampleMeta

MAGIC = b"SLIPSTQ1"
# 2: group headers carry a typed Provenance; 1 (still read): a free-form ``extra`` map in its place.
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sQ")


class SnapGroup(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    partition: str
    # Leased when the snapshot was taken; restored as ready (in front, order kept).
    leased: bool
    meta: GroupMeta
    tensors: list[P.TensorSpec]
    # Blob size and its offset in the payload section.
    nbytes: int
    offset: int


class SnapshotHeader(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    version: int
    created: float
    groups: list[SnapGroup]
    consumed_groups: list[str]
    consumed_uids: list[str]
    dropped: list[GroupMeta]
    # Random per snapshot; a server that wrote (or restored) it can roll back to it. Empty in older files.
    snapshot_id: str = ""


class _FormatOnly(msgspec.Struct, array_like=True, gc=False):
    """The first field of every header format: which types the rest is read with."""

    version: int


class LegacyGroupMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A group header as format 1 stored it, before ``Provenance``: read only, to load those snapshots
    (:meth:`upgrade` gives today's header)."""

    group_id: str
    samples: list[SampleMeta]
    extra: dict[str, Any] = {}

    def upgrade(self) -> GroupMeta:
        return GroupMeta(self.group_id, self.samples, self._provenance())

    def _provenance(self) -> Provenance | None:
        """The provenance the ``extra`` map carried (None if it names no prompt: not a rollouter's group)."""
        extra = self.extra
        if "prompt_index" not in extra:
            return None
        return Provenance(
            prompt_index=int(extra["prompt_index"]),
            epoch=int(extra.get("epoch", 0)),
            attempt=int(extra.get("attempt", 0)),
            data_source=str(extra.get("data_source", "")),
            keep_stale=bool(extra.get("keep_stale", False)),
        )


class _SnapGroupV1(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    partition: str
    leased: bool
    meta: LegacyGroupMeta
    tensors: list[P.TensorSpec]
    nbytes: int
    offset: int


class _SnapshotHeaderV1(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Format 1 (before group provenance was typed), read to load older snapshots."""

    version: int
    created: float
    groups: list[_SnapGroupV1]
    consumed_groups: list[str]
    consumed_uids: list[str]
    dropped: list[LegacyGroupMeta]
    snapshot_id: str = ""

    def upgrade(self) -> SnapshotHeader:
        groups = [
            SnapGroup(g.partition, g.leased, g.meta.upgrade(), g.tensors, g.nbytes, g.offset)
            for g in self.groups
        ]
        dropped = [m.upgrade() for m in self.dropped]
        return SnapshotHeader(FORMAT_VERSION, self.created, groups, self.consumed_groups, self.consumed_uids,
                              dropped, self.snapshot_id)  # fmt: skip


def decode_header(body: bytes) -> SnapshotHeader:
    """A snapshot header of any format this server reads, as today's :class:`SnapshotHeader`."""
    version = msgspec.msgpack.decode(body, type=_FormatOnly).version
    if version == 1:
        return msgspec.msgpack.decode(body, type=_SnapshotHeaderV1).upgrade()
    if version != FORMAT_VERSION:
        raise msgspec.ValidationError(f"snapshot format {version}, this server reads 1 and {FORMAT_VERSION}")
    return msgspec.msgpack.decode(body, type=SnapshotHeader)


class SnapshotItem(msgspec.Struct, gc=False):
    """One group to save: its header data plus the buffers its specs point into (frames, regions, blobs)."""

    partition: str
    leased: bool
    meta: GroupMeta
    tensors: list[P.TensorSpec]
    buffers: list[Any]


def write_snapshot(
    snapshots: SnapshotDir,
    name: str,
    items: Sequence[SnapshotItem],
    consumed_groups: Sequence[str],
    consumed_uids: Sequence[str],
    dropped: Sequence[GroupMeta],
    snapshot_id: str = "",
) -> dict[str, Any]:
    """Write snapshot ``name`` (runs on a worker thread; the server keeps the buffers pinned meanwhile)."""
    groups, offset = [], 0
    for item in items:
        specs, size = blob_layout(item.tensors)
        groups.append(SnapGroup(item.partition, item.leased, item.meta, specs, size, offset))
        offset += size
    header = SnapshotHeader(
        FORMAT_VERSION,
        time.time(),
        groups,
        list(consumed_groups),
        list(consumed_uids),
        list(dropped),
        snapshot_id,
    )
    body = msgspec.msgpack.encode(header)

    def fill(f: BinaryIO) -> None:
        f.write(_PREFIX.pack(MAGIC, len(body)))
        f.write(body)
        f.write(b"\0" * _pad(_PREFIX.size + len(body)))
        for item, group in zip(items, groups, strict=True):
            _write_blob(f, item, group)

    snapshots.write(name, fill)
    return {
        "name": name,
        "groups": len(groups),
        "leased_groups": sum(g.leased for g in groups),
        "bytes": offset,
        "consumed_uids": len(consumed_uids),
        "dropped": len(dropped),
        "snapshot_id": snapshot_id,
    }


def _write_blob(f: Any, item: SnapshotItem, group: SnapGroup) -> None:
    written = 0
    for old, new in zip(item.tensors, group.tensors, strict=True):
        if old.frame < 0:
            continue
        f.write(b"\0" * (new.offset - written))
        src = bytes_view(item.buffers[old.frame])
        n = spec_nbytes(old)
        f.write(src[old.offset : old.offset + n])
        written = new.offset + n
    f.write(b"\0" * (group.nbytes - written))


def _pad(n: int) -> int:
    return -n % ALIGN


def read_snapshot(snapshots: SnapshotDir, name: str) -> tuple[SnapshotHeader, list[bytearray]]:
    """Read and check snapshot ``name``; raise WireError (``bad_request``) naming what is wrong with it."""
    with snapshots.open(name) as f:
        return _read(f, name)


def _read(f: BinaryIO, name: str) -> tuple[SnapshotHeader, list[bytearray]]:
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size or _PREFIX.unpack(prefix)[0] != MAGIC:
        raise WireError("bad_request", f"{name} is not a slipstream queue snapshot")
    length = _PREFIX.unpack(prefix)[1]
    if _PREFIX.size + length > size:
        raise WireError("bad_request", f"{name}: truncated header ({length} bytes announced)")
    try:
        header = decode_header(f.read(length))
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError("bad_request", f"{name}: malformed snapshot header: {err}") from None
    start = _PREFIX.size + length + _pad(_PREFIX.size + length)
    blobs = []
    for g in header.groups:
        validate_group(g.meta, g.tensors, [g.nbytes])
        if g.offset < 0 or start + g.offset + g.nbytes > size:
            raise WireError("bad_request", f"{name}: group {g.meta.group_id!r} lies past the end of the file")
        f.seek(start + g.offset)
        blob = bytearray(g.nbytes)
        if f.readinto(blob) != g.nbytes:
            raise WireError("bad_request", f"{name}: group {g.meta.group_id!r} is cut short")
        blobs.append(blob)
    return header, blobs
