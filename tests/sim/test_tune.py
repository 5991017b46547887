"""`slipstream tune`: every setting inside the autotune bounds simulated, the best within the cap first."""

from __future__ import annotations

import json

from helpers_sim import QUICKSTART, flat_profile

from slipstream.sim import tune
from slipstream.sim.types import save_profile

NARROW = ["trainer.batch_groups=2", "rollout.n=4", "rollout.sampling.max_new_tokens=64",
          "rollout.max_concurrent_per_server=4", "async.autotune_bounds.staleness_threshold_max=0.5",
          "async.autotune_bounds.sync_every_max=2", "async.autotune_bounds.concurrency_min=2",
          "async.autotune_bounds.concurrency_max=8"]  # fmt: skip


def test_the_grid_is_the_bounds():
    from slipstream.sim.simulate import sim_config

    grid = tune.grid(sim_config(QUICKSTART, NARROW))
    assert {s for s, _, _ in grid} == {0.0, 0.25, 0.5}
    assert {e for _, e, _ in grid} == {1, 2} and {c for _, _, c in grid} == {2, 4, 8}


def test_tune_prints_the_recommended_setting(tmp_path, capsys):
    save_profile(flat_profile(), tmp_path / "p.yaml")
    assert (
        tune.main([QUICKSTART, *NARROW, "--profile", str(tmp_path / "p.yaml"), "--steps", "6", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    assert best["within_cap"] and best["tokens_per_s"] > 0
    assert len(out["ranked"]) == 18 and out["overrides"][0].startswith("rollout.max_concurrent_per_server")
    # ranked by steady step time among those within the cap
    ok = [r for r in out["ranked"] if r["within_cap"]]
    assert [r["step_s"] for r in ok] == sorted(r["step_s"] for r in ok)
    png = tmp_path / "tune.png"
    assert (
        tune.main(
            [QUICKSTART, *NARROW, "--profile", str(tmp_path / "p.yaml"), "--steps", "6", "--png", str(png)]
        )
        == 0
    )
    assert "best: " in capsys.readouterr().out and png.stat().st_size > 0


def test_tune_refuses_a_missing_profile(capsys):
    assert tune.main([QUICKSTART, "--profile", "/nonexistent.yaml"]) == 2
    assert "no such file" in capsys.readouterr().err
