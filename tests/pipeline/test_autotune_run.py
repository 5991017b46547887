"""The autotune controller in a real pipeline run on the tiny model: it decides from the metrics the parts
really report (none missing), moves the gate's threshold up from a poor start, and stays in its bounds."""

from __future__ import annotations

import json

from slipstream.pipeline import Pipeline
from tests.pipeline.conftest import pipeline_config


def test_the_controller_acts_on_a_real_runs_metrics_within_its_bounds(ray_pools, tiny_model_path, tmp_path):
    cfg = pipeline_config(
        tmp_path, tiny_model_path,
        "async.mode=fully_async", "async.staleness_threshold=0", "async.max_staleness=2", "run.total_steps=4",
        "async.autotune=throughput", "async.autotune_every=1", "async.autotune_bounds.staleness_threshold_max=0.5",
        prompts=8,
    )  # fmt: skip
    result = Pipeline(cfg).run()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    decided = [r for r in records if "autotune/staleness_threshold" in r]
    assert len(decided) == 4  # autotune_every 1: a decision every step
    assert all(r["autotune/held_missing"] == 0.0 for r in decided)  # every metric it reads is reported
    thresholds = [r["autotune/staleness_threshold"] for r in decided]
    # at threshold 0 the gate admits one batch per version, so the trainer waits for every one: it raises
    assert thresholds[-1] > 0.0 and any(r["autotune/changed"] == 1.0 for r in decided)
    assert all(0.0 <= t <= 0.5 for t in thresholds)  # autotune_bounds.staleness_threshold_max
    assert all(r["autotune/sync_every"] == 1.0 for r in decided)  # the pipeline moves only the threshold
    assert all(r["trainer/staleness_versions_max"] <= 2.0 for r in records)  # the cap, enforced
