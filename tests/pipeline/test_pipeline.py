"""The whole pipeline across real processes on the tiny model: each mode end to end, resuming a run from
its checkpoint, and configs that must fail before anything starts.

Every run records the uids each step trained (``run.record_uids``) and has exactly ``total_steps *
batch_groups`` prompts, so "nothing lost, nothing trained twice" reads: every prompt's group is trained
exactly once and no uid twice.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from slipstream.pipeline import Pipeline, main
from slipstream.pipeline.checkpoint import read_trained_uids
from tests.pipeline.conftest import group_of, pipeline_config, write_prompts


def assert_each_prompt_trained_once(run_dir, total_steps: int, batch_groups: int = 2, n: int = 4) -> None:
    steps = read_trained_uids(run_dir)
    assert sorted(steps) == list(range(1, total_steps + 1))
    uids = [u for step in steps.values() for u in step]
    assert len(uids) == len(set(uids)) == total_steps * batch_groups * n, "a sample was trained twice"
    per_prompt = Counter(group_of(u) for u in uids)
    assert len(per_prompt) == total_steps * batch_groups, "a prompt was lost"
    assert set(per_prompt.values()) == {n}


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_mode_trains_on_fresh_samples_only(ray_pools, tiny_model_path, tmp_path):
    cfg = pipeline_config(tmp_path, tiny_model_path, "async.mode=sync", "run.total_steps=3", prompts=6)
    result = Pipeline(cfg).run()
    assert result.version == 3
    assert_each_prompt_trained_once(result.run_dir, 3)
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for rec in records:
        assert rec["trainer/staleness_versions_max"] == 0.0  # every sample came from the weights it trains
        assert rec["sync/version"] == rec["step"] and rec["sync/servers_ok"] == 1.0
        for key in (
            "trainer/idle_ratio",
            "rollouter/idle_ratio",
            "trainer/reward_mean",
            "perf/samples_per_s",
        ):
            assert key in rec
    from slipstream.plot import plot_run

    names = {p.name for p in plot_run(result.run_dir)}
    assert {"reward.png", "staleness.png", "idle_ratio.png", "throughput.png", "summary.png"} <= names


def test_one_step_off_run_resumes_from_its_checkpoint(ray_pools, tiny_model_path, tmp_path):
    """A run stops after 2 steps (checkpoint); the same run asked for 4 steps continues from step 2, with
    the queue restored from the snapshot and the rollouter from its saved prompts."""
    args = ("async.mode=one_step_off", "trainer.checkpoint_every=2")
    first = Pipeline(pipeline_config(tmp_path, tiny_model_path, *args, "run.total_steps=2", prompts=8)).run()
    assert first.version == 2 and (first.run_dir / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    second = Pipeline(pipeline_config(tmp_path, tiny_model_path, *args, "run.total_steps=4", prompts=8)).run()
    assert second.version == 4
    assert_each_prompt_trained_once(second.run_dir, 4)
    records = read_metrics(second.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["trainer/staleness_versions_max"] <= 1.0 for r in records)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.lrr=1"], "trainer.lrr"),
        (["trainer.mini_batches=3"], "trainer.mini_batches"),
        (["run.total_steps=100"], "run.total_steps"),
        (["data.train_files=[/nonexistent/prompts.jsonl]"], "data.train_files"),
        (["trainer.algorithm.policy_loss=ppo_clipp"], "trainer.algorithm.policy_loss"),
        (["cluster.restart_trainer=true", "trainer.checkpoint_every=0"], "trainer.checkpoint_every"),
        (["cluster.restart_servers=true", "weightsync.keep_last=false"], "weightsync.keep_last"),
        (["queue.capacity_groups=1"], "queue.capacity_groups"),
        (["model.path=/nonexistent/model"], "model.path"),
    ],
)
def test_a_bad_config_fails_before_anything_starts_naming_the_key(
    tiny_model_path, tmp_path, capsys, overrides, key
):
    data = write_prompts(tmp_path / "prompts.jsonl", 4)
    preset = tmp_path / "run.yaml"
    preset.write_text(
        f"run: {{output_dir: {tmp_path / 'runs'}, name: bad, total_steps: 1}}\n"
        f"model: {{path: {tiny_model_path}}}\ndata: {{train_files: [{data}]}}\ntrainer: {{batch_groups: 2}}\n"
    )
    assert main([str(preset), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and key in err
    assert not (tmp_path / "runs").exists()  # the run directory is the first thing a start creates
