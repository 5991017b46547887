"""A trainer rank that Ray's memory monitor killed is a dead rank: the step loop restarts the trainer (with
``cluster.restart_trainer``) instead of ending the run on an error it does not expect. Ray reports such a
kill as ``OutOfMemoryError``, which is not a ``RayActorError``."""

from __future__ import annotations

import pytest
import ray

from slipstream.pipeline.controller import Pipeline, _TrainerDied


def _killed_for_memory(*args, **kwargs):
    raise ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")


def test_a_rank_killed_for_memory_during_a_step_is_a_dead_rank(monkeypatch):
    monkeypatch.setattr(ray, "get", _killed_for_memory)
    pipeline = Pipeline.__new__(Pipeline)  # nothing started: only the result handling is exercised
    with pytest.raises(_TrainerDied, match="a trainer rank died"):
        pipeline._rank_result(object())


def test_a_rank_killed_for_memory_during_a_push_is_a_dead_rank(monkeypatch):
    monkeypatch.setattr(ray, "get", _killed_for_memory)
    pipeline = Pipeline.__new__(Pipeline)
    pipeline.ranks = []
    with pytest.raises(_TrainerDied, match="died during publish"):
        pipeline._ranks_call("publish", 1.0, 7)
