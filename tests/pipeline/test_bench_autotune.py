"""`slipstream bench autotune` builds valid configs for its two runs: the same workload and poor start, the
controller on in one only, and the driver's decision lines collected."""

from __future__ import annotations

import logging
from pathlib import Path

from slipstream.config import load_config
from slipstream.pipeline.modes import prepare_config
from slipstream.system.bench_autotune import _Decisions, _overrides, _parser
from slipstream.system.e2e import QUICKSTART


def test_both_runs_start_from_the_same_poor_setting_and_differ_only_in_autotune(tmp_path: Path):
    args = _parser().parse_args(["--steps", "3"])
    data = tmp_path / "prompts.parquet"
    off, on = (
        prepare_config(load_config(QUICKSTART, _overrides(args, m, tmp_path, data)))[0] for m in ("off", "on")
    )
    assert (off.async_.autotune, on.async_.autotune) == ("off", "throughput")
    for cfg in (off, on):
        assert cfg.async_.mode == "fully_async" and cfg.async_.staleness_threshold == 0.0
        assert cfg.async_.max_staleness == cfg.async_.autotune_bounds.staleness_cap == 2
        assert cfg.run.total_steps == 3 and cfg.rollout.backend == "embedded" and cfg.eval_.every == 0
        assert (cfg.rollout.embedded.num_threads, cfg.cluster.trainer_threads) == (1, 1)
    assert off.run.name != on.run.name


def test_the_decision_lines_are_collected():
    handler = _Decisions()
    log = logging.getLogger("test.bench_autotune")
    log.addHandler(handler)
    log.warning("autotune at step 2: raise async.staleness_threshold 0 -> 0.5: the trainer waits")
    log.warning("something else")
    log.removeHandler(handler)
    assert handler.lines == ["2: raise async.staleness_threshold 0 -> 0.5: the trainer waits"]
