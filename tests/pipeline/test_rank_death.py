"""A trainer rank that Ray's memory monitor killed is a dead rank: the step loop restarts the trainer (with
``cluster.restart_trainer``) instead of ending the run on an error it does not expect. Ray reports such a
kill as ``OutOfMemoryError``, which is not a ``RayActorError``; the Ray cluster turns both into
``ActorDied``, which the step driver and the rank calls turn into ``TrainerDied``."""

from __future__ import annotations

import pytest
import ray

from slipstream.pipeline.actors import TrainerRank
from slipstream.pipeline.cluster import ActorDied, Pending, RayCluster, TrainerDied
from slipstream.pipeline.driver import StepDriver
from slipstream.pipeline.handles import TrainerGroup
from slipstream.pipeline.parts import Parts
from tests.pipeline.fake_cluster import FakeCluster, fake_config


def _killed_for_memory(*args, **kwargs):
    raise ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")


def test_ray_reports_a_rank_killed_for_memory_as_a_dead_actor(monkeypatch):
    monkeypatch.setattr(ray, "get", _killed_for_memory)
    with pytest.raises(ActorDied, match="killed due to the node running low on memory"):
        RayCluster().get(Pending(object()), 1.0)


def test_a_rank_that_died_during_a_step_is_a_dead_rank():
    cluster = FakeCluster()
    rank = cluster.spawn("rank0", object)
    cluster.die(rank)
    driver = StepDriver.__new__(StepDriver)  # only the result handling is exercised
    driver.cluster, driver.cfg, driver.parts = cluster, fake_config(), Parts()
    with pytest.raises(TrainerDied, match="a trainer rank died"):
        driver.rank_result(cluster.call(rank, TrainerRank.step))


def test_a_rank_that_died_during_a_push_is_a_dead_rank():
    cluster = FakeCluster()
    rank = cluster.spawn("rank0", object)
    cluster.die(rank)
    with pytest.raises(TrainerDied, match="died during publish"):
        TrainerGroup(cluster, [rank]).publish(7, timeout_s=1.0)
