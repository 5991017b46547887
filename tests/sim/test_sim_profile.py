"""Profiles: the YAML round trip, errors that name the field, and a profile fitted to a recorded run."""

from __future__ import annotations

import json

import pytest
from helpers_sim import QUICKSTART, flat_profile

from slipstream.config import load_config, to_yaml
from slipstream.sim.profile import (
    ProfileError,
    fit_lengths,
    load_profile,
    parse_profile,
    profile_from_run,
    save_profile,
)


def write_run(run_dir, mode="sync", steps=6, wait_s=4.0, cycle_s=10.0, extra=None):
    """A recorded run as the pipeline writes it: config.yaml and one metrics.jsonl record per step."""
    run_dir.mkdir(parents=True)
    overrides = [f"async.mode={mode}", "trainer.batch_groups=2", "rollout.n=4",
                 "rollout.sampling.max_new_tokens=64", "eval.every=0"]  # fmt: skip
    (run_dir / "config.yaml").write_text(to_yaml(load_config(QUICKSTART, overrides)))
    lines = []
    for step in range(1, steps + 1):
        lines.append(json.dumps({
            "step": step, "perf/elapsed_s": 5.0 + cycle_s * step, "perf/step_wall_s": 8.0,
            "trainer/step_s": 8.0, "trainer/idle_ratio": wait_s / 8.0, "trainer/tokens": 560.0,
            "trainer/samples": 8.0, "trainer/response_len_mean": 50.0,
            "rollouter/generated_tokens_per_s": 40.0, "rollouter/idle_ratio": 0.5,
            "rollouter/finish_length": 0.0, "sync/bytes": 1.0e6, "sync/publish_s": 0.5, "sync/drain_s": 0.0,
            **(extra or {}),
        }))  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_round_trip(tmp_path):
    prof = flat_profile()
    save_profile(prof, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == prof


@pytest.mark.parametrize(
    "change,field",
    [
        ({"prefill_tokens_per_s": -1}, "prefill_tokens_per_s"),
        ({"trainer": {"tokens_per_s_per_rank": "fast"}}, "trainer.tokens_per_s_per_rank"),
        ({"decode": {"concurrency": [1, 8], "tokens_per_s": [10]}}, "decode.tokens_per_s"),
        ({"decode": {"concurrency": [8, 1], "tokens_per_s": [10, 20]}}, "decode.concurrency"),
        ({"lengths": {"mean": 50, "sigmaa": 1}}, "lengths.sigmaa"),
        ({"push": {"model_bytes": -5}}, "push.model_bytes"),
    ],
)
def test_errors_name_the_field(change, field):
    data = {
        "decode": {"concurrency": [1], "tokens_per_s": [10]},
        "prefill_tokens_per_s": 100,
        "prompt_tokens": 20,
        "lengths": {"mean": 50},
        "trainer": {"tokens_per_s_per_rank": 280},
    }
    data.update(change)
    with pytest.raises(ProfileError, match=f"profile field {field}"):
        parse_profile(data)


def test_missing_field_and_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="trainer"):
        parse_profile({"decode": {"concurrency": [1], "tokens_per_s": [10]}, "prefill_tokens_per_s": 1,
                       "prompt_tokens": 1, "lengths": {"mean": 5}})  # fmt: skip
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "none.yaml")


def test_fit_lengths_matches_the_clipped_mean_and_the_share_at_the_cap():
    import math
    import random

    mean, sigma = fit_lengths(40.0, 96.0, 0.05)
    rng = random.Random(0)
    mu = math.log(mean) - sigma * sigma / 2
    draws = [min(96.0, rng.lognormvariate(mu, sigma)) for _ in range(40000)]
    assert sum(draws) / len(draws) == pytest.approx(40.0, rel=0.03)
    assert sum(d >= 96.0 for d in draws) / len(draws) == pytest.approx(0.05, abs=0.01)


def test_profile_from_a_recorded_run_reproduces_its_wait(tmp_path):
    run = write_run(tmp_path / "sync")
    prof = profile_from_run(run)
    # trainer: 4 s of compute (8 s step less 4 s waiting) for 560 tokens on one rank
    assert prof.trainer.tokens_per_s_per_rank == pytest.approx(140.0)
    assert prof.prompt_tokens == pytest.approx(20.0)
    assert prof.push.s_per_byte * prof.push.model_bytes == pytest.approx(0.5)
    assert prof.step_overhead_s == pytest.approx(1.5)  # 10 s cycle - 8 s step - 0.5 s push
    assert prof.lengths.drift_per_step == 0.0  # six steps: too few to tell
    from slipstream.sim.simulate import sim_config, simulate

    res = simulate(sim_config(str(run / "config.yaml")), prof, steps=6)
    waits = [i * s for i, s in zip(res.trainer_idle, res.step_s, strict=True)][1:]
    assert sum(waits) / len(waits) == pytest.approx(4.0, rel=0.02)


def test_a_profile_from_a_filtering_run_takes_its_filter_ratio(tmp_path):
    from slipstream.sim.profile import profile_from_run

    plain = profile_from_run(write_run(tmp_path / "plain"))
    filtering = profile_from_run(write_run(tmp_path / "ds", extra={"rollouter/filter_ratio": 0.25}))
    assert plain.filtered_fraction == 0.0
    assert filtering.filtered_fraction == pytest.approx(0.25)
