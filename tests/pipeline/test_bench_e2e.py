"""`slipstream bench e2e` builds valid configs for both modes: the same workload, each mode's own layout, and
the staleness knobs only where they mean something (every override is checked by the config loader)."""

from __future__ import annotations

from pathlib import Path

from slipstream.config import load_config
from slipstream.system.e2e import QUICKSTART, _overrides, _parser


def test_both_modes_get_the_same_workload_and_their_own_layout(tmp_path: Path):
    args = _parser().parse_args(["--steps", "3", "--staleness-threshold", "2", "--max-staleness", "4"])
    data = tmp_path / "prompts.parquet"
    sync = load_config(QUICKSTART, _overrides(args, "sync", tmp_path, data))
    fast = load_config(QUICKSTART, _overrides(args, "fully_async", tmp_path, data))
    for cfg in (sync, fast):
        assert cfg.run.total_steps == 3 and cfg.rollout.sampling.max_new_tokens == 384
        assert cfg.data.train_files == [str(data)] and cfg.trainer.checkpoint_every == 0
    assert (sync.async_.mode, fast.async_.mode) == ("sync", "fully_async")
    assert (sync.rollout.embedded.num_threads, sync.cluster.trainer_threads) == (2, 2)
    assert (fast.rollout.embedded.num_threads, fast.cluster.trainer_threads) == (1, 1)
    assert (fast.async_.staleness_threshold, fast.async_.max_staleness) == (2.0, 4)
    preset = load_config(QUICKSTART)
    assert sync.async_.max_staleness == preset.async_.max_staleness  # sync keeps the preset's
