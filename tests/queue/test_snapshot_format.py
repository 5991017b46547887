"""Group provenance in queue snapshots: today's format keeps it typed, and a snapshot written before it was
typed (format 1: a free-form ``extra`` map in each group header) still loads, its map read into the typed
``Provenance``."""

from __future__ import annotations

import struct
import time

import msgspec
import pytest

from slipstream.queue import protocol as P
from slipstream.queue.codec import ALIGN, pack_frames
from slipstream.queue.snapdir import SnapshotDir
from slipstream.queue.snapshot import FORMAT_VERSION, MAGIC, read_snapshot
from slipstream.queue.testing import make_group
from slipstream.queue.types import GroupMeta, Provenance
from tests.queue.test_controller import OTHER, PRODUCER, Queue, _ids

ORIGIN = Provenance(prompt_index=7, epoch=1, attempt=2, data_source="gsm8k", keep_stale=True)


@pytest.fixture
def make_queue():
    made: list[Queue] = []

    def make(**cfg: object) -> Queue:
        made.append(Queue(**cfg))
        return made[-1]

    yield make
    for queue in made:
        queue.ctl.close()
        queue.unit.close()


def put_with(q, gid: str, provenance: Provenance | None) -> None:
    group = make_group(gid)
    group.meta.provenance = provenance
    specs, views = pack_frames(group.tensors, 0)
    q.ctl.handle_put(
        0, (PRODUCER, b""), P.PutRequest(1, "train", group.meta, specs, 5.0), [bytes(v) for v in views]
    )


def format_1_file(directory, name: str, extras: dict[str, dict], dropped: dict[str, dict]) -> None:
    """A snapshot as the queue wrote it before group provenance was typed: groups ``extras`` (group id ->
    its ``extra`` map) with every tensor inline, and ``dropped`` group headers."""

    def meta(gid: str, extra: dict) -> list:
        group = make_group(gid)
        samples = group.meta.samples
        return [gid, samples, extra] if extra else [gid, samples]

    groups = []
    for gid, extra in extras.items():
        specs, _ = pack_frames(make_group(gid).tensors, 1 << 20)  # everything inline: no payload blob
        groups.append(["train", False, meta(gid, extra), specs, 0, 0])
    header = [1, time.time(), groups, [], [], [meta(gid, extra) for gid, extra in dropped.items()]]
    body = msgspec.msgpack.encode(header)
    prefix = struct.pack("<8sQ", MAGIC, len(body))
    pad = -(len(prefix) + len(body)) % ALIGN
    SnapshotDir(str(directory), MAGIC).write(name, lambda f: f.write(prefix + body + b"\0" * pad))


def test_provenance_survives_a_snapshot_and_a_restore(make_queue, tmp_path):
    q = make_queue(snapshot_dir=str(tmp_path))
    put_with(q, "a", ORIGIN)
    put_with(q, "b", None)
    q.job(q.ctl.handle_snapshot, "s")
    header, _ = read_snapshot(SnapshotDir(str(tmp_path), MAGIC), "s")
    assert header.version == FORMAT_VERSION == 2
    assert [g.meta.provenance for g in header.groups] == [ORIGIN, None]

    fresh = make_queue(snapshot_dir=str(tmp_path))
    fresh.job(fresh.ctl.handle_restore, "s")
    reply = fresh.lease(2, who=OTHER)
    assert [g.meta.provenance for g in reply.groups] == [ORIGIN, None]


def test_a_snapshot_from_before_typed_provenance_still_loads(make_queue, tmp_path):
    legacy = {"prompt_index": 7, "epoch": 1, "attempt": 2, "data_source": "gsm8k", "keep_stale": True}
    format_1_file(
        tmp_path,
        "old",
        extras={"e1-p7-a2": legacy, "bench-0": {}},
        dropped={"e0-p3": {"prompt_index": 3, "epoch": 0, "attempt": 0, "data_source": "math"}},
    )
    header, _ = read_snapshot(SnapshotDir(str(tmp_path), MAGIC), "old")
    assert [g.meta.provenance for g in header.groups] == [ORIGIN, None]

    fresh = make_queue(snapshot_dir=str(tmp_path))
    summary = fresh.job(fresh.ctl.handle_restore, "old").summary
    assert (summary["groups"], summary["dropped"]) == (2, 1)
    reply = fresh.lease(2, who=OTHER)
    assert _ids(reply) == ["e1-p7-a2", "bench-0"]
    assert reply.groups[0].meta.provenance == ORIGIN and reply.groups[0].meta.keep_stale
    fresh.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(90, 10), [])
    (meta,) = fresh.last(PRODUCER).groups
    assert isinstance(meta, GroupMeta)
    assert meta.provenance == Provenance(prompt_index=3, data_source="math")


def test_provenance_is_tagged_with_its_schema_on_the_wire():
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ORIGIN))
    assert wire == [1, 7, 1, 2, "gsm8k", True]
    meta = GroupMeta("g", [], Provenance(prompt_index=0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=GroupMeta) == meta
