"""Shared builders of the simulator tests: a profile with round numbers and a small config."""

from __future__ import annotations

from pathlib import Path

from slipstream.sim.profile import parse_profile
from slipstream.sim.simulate import sim_config

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def flat_profile(**changes):
    """Each request decodes 10 tokens/s whatever the concurrency; every response is 50 tokens."""
    data = {
        "decode": {"concurrency": [1, 1000], "tokens_per_s": [10, 10000]},
        "prefill_tokens_per_s": 100,
        "prompt_tokens": 20,
        "lengths": {"mean": 50, "samples": [50]},
        "trainer": {"tokens_per_s_per_rank": 280, "fixed_s": 1.0},
        "push": {"fixed_s": 0.5},
        "step_overhead_s": 0.25,
    }
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return parse_profile(data)


def small_config(*overrides: str):
    base = ["trainer.batch_groups=2", "rollout.n=4", "rollout.max_concurrent_per_server=64",
            "rollout.sampling.max_new_tokens=64"]  # fmt: skip
    return sim_config(QUICKSTART, [*base, *overrides])
