"""Group provenance and sample outcomes in queue snapshots and headers: today's format keeps them typed, and
what was written before they were typed still loads. A format-1 snapshot's group headers carry a free-form
``extra`` map, read into the typed ``Provenance``; every older sample header (format 1 or 2, or an older
client's put) carries the rollouter's ``extra`` map where ``SampleOutcome`` sits now, read into it."""

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
from slipstream.queue.types import GroupMeta, Provenance, SampleMeta, SampleOutcome
from tests.queue.test_controller import OTHER, PRODUCER, Queue, _ids

ORIGIN = Provenance(prompt_index=7, epoch=1, attempt=2, data_source="gsm8k", keep_stale=True)
# The per-sample maps the rollouter wrote before SampleOutcome (a sample scored normally, one whose reward
# call failed, an earlier segment of an agent episode), and what each now reads as.
OLD_SAMPLE_EXTRAS = [
    {"data_source": "gsm8k", "prompt_index": 7},
    {"data_source": "gsm8k", "prompt_index": 7, "reward_error": "timeout"},
    {"data_source": "gsm8k", "prompt_index": 7, "segment": 0},
]
OUTCOMES = [SampleOutcome(), SampleOutcome(reward_error="timeout"), SampleOutcome(segment=0)]


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


def old_samples(gid: str) -> list[list]:
    """``make_group(gid, n=3)``'s sample headers as written before SampleOutcome: in its slot, the map of
    :data:`OLD_SAMPLE_EXTRAS`."""
    samples = msgspec.to_builtins(make_group(gid, n=len(OLD_SAMPLE_EXTRAS)).meta.samples)
    slot = SampleMeta.__struct_fields__.index("outcome")
    for sample, extra in zip(samples, OLD_SAMPLE_EXTRAS, strict=True):
        sample[slot] = extra
    return samples


def old_file(directory, name: str, version: int, metas: list[list], dropped: list[list]) -> None:
    """A snapshot of format ``version`` from raw group headers (each group of ``make_group(gid, n=3)``, every
    tensor inline) and ``dropped`` group headers."""
    groups = []
    for meta in metas:  # every tensor inline: no payload blob
        specs, _ = pack_frames(make_group(meta[0], n=3).tensors, 1 << 20)
        groups.append(["train", False, meta, specs, 0, 0])
    body = msgspec.msgpack.encode([version, time.time(), groups, [], [], dropped])
    prefix = struct.pack("<8sQ", MAGIC, len(body))
    pad = -(len(prefix) + len(body)) % ALIGN
    SnapshotDir(str(directory), MAGIC).write(name, lambda f: f.write(prefix + body + b"\0" * pad))


def format_1_file(directory, name: str, extras: dict[str, dict], dropped: dict[str, dict]) -> None:
    """A snapshot as the queue wrote it before group provenance was typed: groups ``extras`` (group id ->
    its ``extra`` map), and ``dropped`` group headers."""

    def meta(gid: str, extra: dict) -> list:
        return [gid, old_samples(gid), extra] if extra else [gid, old_samples(gid)]

    old_file(directory, name, 1, [meta(gid, extra) for gid, extra in extras.items()],
             [meta(gid, extra) for gid, extra in dropped.items()])  # fmt: skip


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
    assert [s.outcome for g in reply.groups for s in g.meta.samples] == OUTCOMES * 2
    fresh.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(90, 10), [])
    (meta,) = fresh.last(PRODUCER).groups
    assert isinstance(meta, GroupMeta)
    assert meta.provenance == Provenance(prompt_index=3, data_source="math")


def test_provenance_is_tagged_with_its_schema_on_the_wire():
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ORIGIN))
    assert wire == [1, 7, 1, 2, "gsm8k", True]
    meta = GroupMeta("g", [], Provenance(prompt_index=0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=GroupMeta) == meta


def test_sample_outcomes_survive_a_snapshot_and_a_restore(make_queue, tmp_path):
    q = make_queue(snapshot_dir=str(tmp_path))
    group = make_group("a", n=3)
    for sample, outcome in zip(group.meta.samples, OUTCOMES, strict=True):
        sample.outcome = outcome
    specs, views = pack_frames(group.tensors, 0)
    q.ctl.handle_put(
        0, (PRODUCER, b""), P.PutRequest(1, "train", group.meta, specs, 5.0), [bytes(v) for v in views]
    )
    q.job(q.ctl.handle_snapshot, "s")

    fresh = make_queue(snapshot_dir=str(tmp_path))
    fresh.job(fresh.ctl.handle_restore, "s")
    (restored,) = fresh.lease(1, who=OTHER).groups
    assert [s.outcome for s in restored.meta.samples] == OUTCOMES


def test_a_snapshot_from_before_typed_sample_outcomes_still_loads(make_queue, tmp_path):
    """Format 2 as written before SampleOutcome: typed provenance, the rollouter's map in every sample."""
    provenance = msgspec.to_builtins(ORIGIN)
    old_file(tmp_path, "old", 2, [["e1-p7-a2", old_samples("e1-p7-a2"), provenance]],
             [["e0-p3", old_samples("e0-p3")]])  # fmt: skip
    fresh = make_queue(snapshot_dir=str(tmp_path))
    fresh.job(fresh.ctl.handle_restore, "old")
    (group,) = fresh.lease(1, who=OTHER).groups
    assert group.meta.provenance == ORIGIN
    assert [s.outcome for s in group.meta.samples] == OUTCOMES
    fresh.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(90, 10), [])
    (dropped,) = fresh.last(PRODUCER).groups
    assert [s.outcome for s in dropped.samples] == OUTCOMES


def test_an_older_sample_header_decodes_into_the_typed_outcome():
    """A put from an older client: the rollouter's map decodes into SampleOutcome, its data_source and
    prompt_index (which repeated the group's provenance) skipped; the one byte of a default outcome."""
    old = msgspec.msgpack.encode(["g", old_samples("g"), msgspec.to_builtins(ORIGIN)])
    meta = msgspec.msgpack.decode(old, type=GroupMeta)
    assert [s.outcome for s in meta.samples] == OUTCOMES and meta.provenance == ORIGIN
    assert msgspec.msgpack.encode(SampleOutcome()) == b"\x80"  # {}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=GroupMeta) == meta
