"""Rollouter window metrics: staleness is counted in weight versions, the unit of ``async.max_staleness``."""

from __future__ import annotations

from slipstream.rollouter.stats import RolloutStats


def _record(stats: RolloutStats, versions: list[int], current: int) -> None:
    stats.record_trajectory(
        versions=versions,
        current_version=current,
        num_resumes=0,
        reward=1.0,
        reward_error=False,
        response_len=len(versions),
        num_turns=1,
        finish_reason="stop",
    )


def test_staleness_is_in_versions_with_a_push_every_few_steps():
    stats = RolloutStats(sync_every=4)
    _record(stats, [8, 8, 9], current=12)  # 4 steps = 1 push behind
    _record(stats, [0, 4], current=12)  # 12 steps = 3 pushes behind
    _record(stats, [11], current=12)  # same version
    out = stats.collect(tokens=0, busy_s=0.0, gauges={})
    assert out["rollouter/staleness_versions_max"] == 3.0
    assert out["rollouter/staleness_versions_p50"] == 1.0
    assert out["rollouter/staleness_versions_mean"] == 4 / 3
    assert not any(k.startswith("rollouter/staleness_") and "versions" not in k for k in out)
