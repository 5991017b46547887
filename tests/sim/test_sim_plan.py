"""plan capacity: the search returns the fastest candidate within the staleness cap; bench simulate on
recorded runs."""

from __future__ import annotations

import json

import pytest
from helpers_sim import QUICKSTART, flat_profile
from test_sim_profile import write_run

from slipstream.sim import bench, plan
from slipstream.sim.profile import save_profile


def test_search_ranks_the_fastest_within_the_cap_first(tmp_path):
    # Long responses and a fast trainer: higher thresholds are faster but max_staleness 0 drops what they
    # generate ahead, so the best within the cap is not simply the highest threshold.
    prof = flat_profile(lengths={"mean": 200, "samples": [200]}, trainer={"tokens_per_s_per_rank": 400})
    overrides = ["trainer.batch_groups=2", "rollout.n=4", "rollout.sampling.max_new_tokens=256",
                 "async.max_staleness=0", "cluster.gpus_per_server=1", "eval.every=0"]  # fmt: skip
    ranked, ref = plan.search(QUICKSTART, overrides, prof, 4, thresholds=[0.0, 1.0, 3.0], sync_every=[1],
                              concurrency=[1.0], steps=6, refine=1)  # fmt: skip
    within = [c for c in ranked if c.within_cap]
    assert within and ranked[0] is within[0]
    assert all(ranked[0].result.step_s_steady <= c.result.step_s_steady for c in within)
    assert any(not c.within_cap for c in ranked)  # the cap did bind somewhere
    assert all(c.rollout_gpus + c.trainer_gpus == 4 for c in ranked)
    assert ref.mode == "sync" and ref.result.steps == 6
    assert f"trainer.num_ranks={ranked[0].ranks}" in ranked[0].overrides()


def test_plan_command_prints_the_best_overrides_and_draws_the_frontier(tmp_path, capsys):
    save_profile(flat_profile(), tmp_path / "p.yaml")
    png = tmp_path / "frontier.png"
    argv = [QUICKSTART, "trainer.batch_groups=2", "rollout.n=4", "eval.every=0", "--profile",
            str(tmp_path / "p.yaml"), "--gpus", "3", "--steps", "4", "--thresholds", "0,1", "--sync-every", "1",
            "--concurrency", "1", "--refine", "1", "--png", str(png)]  # fmt: skip
    from slipstream.cli import main

    assert main(["plan", *argv]) == 0  # `plan CONFIG` is `plan capacity CONFIG`
    out = capsys.readouterr().out
    assert "best: rollout.num_servers=" in out
    assert png.stat().st_size > 0


def test_bench_simulate_on_recorded_runs(tmp_path, capsys):
    write_run(tmp_path / "runs" / "sync", "sync")
    write_run(tmp_path / "runs" / "async", "fully_async", wait_s=1.0, cycle_s=6.0)
    assert bench.main(["--runs", str(tmp_path / "runs"), "--skip-verl", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(row) >= {"own_runs_max_rel_err", "verl_ratio_published", "verl_ratio_simulated", "seconds"}
    modes = {r["mode"]: r for r in row["own_runs"]}
    assert set(modes) == {"sync", "fully_async"}
    assert modes["sync"]["step_rel_err"] < 0.15  # the profiled run itself
    assert row["own_runs_max_rel_err"] == max(r["step_rel_err"] for r in row["own_runs"])


@pytest.mark.slow
def test_verl_profile_calibrates_to_the_published_sync_steps():
    shipped = bench.load_profile(bench.VERL_PROFILE)
    cal = bench.calibrate_verl(shipped)
    sync = bench.simulate(bench.verl_config(bench.VERL_SYNC_OVERRIDES), cal, steps=6)
    assert sync.step_s_steady == pytest.approx(bench.VERL_STEP_S["sync"], rel=0.03)
    assert bench._same_fit(shipped, cal)  # the shipped profile is the fitted one
    # the async pools' workload: 16 servers generate a sync step as the 64-GPU run did
    pool = bench.fit_pool_lengths(cal)
    assert 0.3 < pool.lengths.mean / cal.lengths.mean < 1.0  # that run's responses were shorter
    gen16, _ = bench._sync_gen_s(pool, bench._sync64_overrides(), 4)
    assert gen16 == pytest.approx(bench.VERL_SYNC64_GEN_S, rel=0.03)


def test_the_recorded_quickstart_runs_of_every_mode_are_reproduced_within_15_percent(capsys):
    """docs/recorded/simulate-own: bench e2e's three modes recorded on a quiet 2-core machine (docs/benchmarks.md,
    "Our own runs"); the sync run's profile predicts the other two. The simulation is deterministic."""
    runs = bench.ROOT / "docs" / "recorded" / "simulate-own"
    rows = []
    for _ in range(2):
        assert bench.main(["--runs", str(runs), "--skip-verl", "--json"]) == 0
        rows.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert rows[0]["own_runs"] == rows[1]["own_runs"]
    assert {r["mode"] for r in rows[0]["own_runs"]} == {"sync", "one_step_off", "fully_async"}
    assert rows[0]["own_runs_max_rel_err"] < 0.15
    for r in rows[0]["own_runs"]:  # idle ratios within 15 points
        assert abs(r["trainer_idle_simulated"] - r["trainer_idle_measured"]) < 0.15
        assert abs(r["rollouter_idle_simulated"] - r["rollouter_idle_measured"]) < 0.15


def test_the_shipped_verl_profile_is_the_calibrated_one():
    """As shipped (no fitting at run time), the profile gives verl's published 128-GPU sync step."""
    prof = bench.load_profile(bench.VERL_PROFILE)
    sync = bench.simulate(bench.verl_config(bench.VERL_SYNC_OVERRIDES), prof, steps=6)
    assert sync.step_s_steady == pytest.approx(bench.VERL_STEP_S["sync"], rel=0.03)


def test_the_verl_fits_are_one_table_of_sync_figures_only():
    prof = bench.load_profile(bench.VERL_PROFILE)
    pool = bench._with(prof, lengths={"mean": prof.lengths.mean * 0.6})
    table = bench.fitted_table(prof, pool, 500.0)
    by_name = {row["constant"]: row for row in table}
    assert by_name["lengths.sigma"]["value"] == prof.lengths.sigma
    assert by_name["decode.tokens_per_s at 256 (one 4-GPU server)"]["value"] == prof.decode.tokens_per_s[-1]
    assert by_name["lengths.mean scale on the async pools"]["value"] == 0.6
    for row in table:
        assert "sync" in row["fitted_to"]
        for name in ("stream", "s0.1", "s0.3", "s0.5"):  # no published asynchronous figure is fitted to
            assert f"{bench.VERL_STEP_S[name]}" not in row["fitted_to"], row
    assert bench._same_fit(prof, prof)
    # verl's runs keep every group: its simulations run without the recipe's dynamic sampling
    assert bench.sim_config(str(bench.VERL_RECIPE)).rollout.dynamic_sampling.enable
    assert not bench.verl_config([]).rollout.dynamic_sampling.enable
