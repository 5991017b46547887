"""The hard staleness cap counts weight versions (pushes), not trainer steps, and spares groups the
rollouter marked ``keep_stale`` (a prompt already dropped ``async.max_stale_drops`` times)."""

from __future__ import annotations

from slipstream.config import load_config, trainer_settings
from slipstream.queue.types import Provenance
from slipstream.trainer.trainer import Trainer
from tests.trainer.fake_queue import FakeQueue, make_group


def lease_with(step: int, groups, *overrides: str) -> FakeQueue:
    cfg = load_config(None, ["trainer.batch_groups=1", "async.stale_policy=drop", *overrides])
    queue = FakeQueue()
    for group in groups:
        queue.put(group)
    trainer = Trainer(
        trainer_settings(cfg), engine=None, queue=queue, rank=0, world_size=1
    )  # leasing needs no engine
    trainer.version = step
    _, dropped, held = trainer._lease_groups()
    queue.held = [g.group_id for g in held]
    return queue


def test_staleness_is_counted_in_pushes_when_sync_every_spans_several_steps():
    settings = trainer_settings(load_config(None, ["async.sync_every=4"]))
    assert [settings.staleness(step, 8) for step in (8, 11, 12, 15, 16)] == [0, 0, 1, 1, 2]
    # A group from version 0 at step 12 is 12 steps but 3 pushes old: within a cap of 3 versions.
    queue = lease_with(12, [make_group("old", 2, version=0)], "async.sync_every=4", "async.max_staleness=3")
    assert queue.held == ["old"] and queue.dropped == []
    queue = lease_with(
        16, [make_group("older", 2, version=0), make_group("fresh", 2, version=4, seed=1)],
        "async.sync_every=4", "async.max_staleness=3",
    )  # fmt: skip
    assert queue.dropped == ["older"] and queue.held == ["fresh"]


def test_one_step_per_push_keeps_the_step_count():
    queue = lease_with(
        3, [make_group("old", 2, version=0), make_group("new", 2, version=2, seed=1)],
        "async.sync_every=1", "async.max_staleness=1",
    )  # fmt: skip
    assert queue.dropped == ["old"] and queue.held == ["new"]


def test_a_group_marked_keep_stale_is_trained_whatever_its_staleness():
    marked = make_group("e0-p3-a2", 2, version=0)
    marked.meta.provenance = Provenance(prompt_index=3, attempt=2, keep_stale=True)
    queue = lease_with(40, [marked], "async.sync_every=4", "async.max_staleness=2")
    assert queue.held == ["e0-p3-a2"] and queue.dropped == []
