"""The simulator with knobs changed mid-run and a server lost, and a small, fast run of the autotune
evaluation (its full run is `slipstream simulate --autotune-eval`, docs/benchmarks.md)."""

from __future__ import annotations

import msgspec
from helpers_sim import flat_profile, small_config

from slipstream.config import AutotuneBounds
from slipstream.sim import autotune_eval as ae
from slipstream.sim.simulate import Simulation


def test_knobs_change_mid_run_as_the_gate_and_balancer_see_them():
    sim = Simulation(small_config("async.staleness_threshold=0", "rollout.max_concurrent_per_server=2"),
                     flat_profile(), steps=6)  # fmt: skip
    seen = []

    def on_step(s, metrics):
        seen.append(metrics)
        if s.steps_done == 2:
            s.set_knobs(staleness_threshold=1.0, sync_every=2, concurrency=8)

    sim.on_step = on_step
    res = sim.run()
    assert sim.gate.staleness_threshold == 1.0 and sim.gate.sync_every == 2 and sim.acfg.sync_every == 2
    assert sim.lb.max_concurrent_per_server == 8
    assert res.steps == 6 and len(res.step_log) == 6
    assert {"trainer/idle_ratio", "trainer/tokens", "perf/elapsed_s", "rollouter/requests_queued"} <= set(
        seen[0]
    )
    assert seen[0]["rollouter/requests_queued"] > 0  # 8 requests, 2 slots on the one server


def test_a_lost_server_moves_its_requests_and_comes_back():
    cfg = small_config("rollout.num_servers=2")
    sim = Simulation(cfg, flat_profile(), steps=8)
    sim.on_step = lambda s, m: s.lose_server(0) if s.steps_done == 2 else (
        s.restore_server(0) if s.steps_done == 5 else None)  # fmt: skip
    res = sim.run()
    assert res.steps == 8 and res.resumed_requests > 0
    assert "sim://server0" in sim.lb.alive()


def test_the_eval_on_one_small_workload():
    bounds = AutotuneBounds(staleness_cap=2, staleness_threshold_max=0.5, sync_every_min=1, sync_every_max=2,
                            concurrency_min=4, concurrency_max=16)  # fmt: skip
    row = ae.evaluate(ae.WORKLOADS[0], steps=30, bounds=bounds)
    assert row["workload"] == "short" and row["ratio"] > 0.5
    assert row["bound_violations"] == 0
    assert row["decisions"] and row["decisions"][0]["reason"].startswith("raise")
    final = msgspec.json.decode(msgspec.json.encode(row))["final"]
    assert "rollout.max_concurrent_per_server=16" in final


def test_the_eval_command_prints_its_figures(capsys, monkeypatch):
    monkeypatch.setattr(ae, "static_grid", lambda bounds: [ae.POOR_START])
    assert ae.main(["--autotune-eval", "--steps", "12", "--workloads", "server_lost,short"]) == 0
    out = capsys.readouterr().out
    assert "min_ratio_vs_best_static" in out and "server_lost" in out
