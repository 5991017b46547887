"""Reward functions and the runner: failures score 0 with an error, never crash the caller."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.agents.config import RewardConfig
from slipstream.agents.datagen import make_rows
from slipstream.agents.rewards import resolve
from slipstream.agents.rewards.runner import RewardRunner


def test_arithmetic_and_exact_match():
    arithmetic = resolve("arithmetic")
    assert arithmetic("12", "12", {}) == 1.0
    assert arithmetic("5 + 7 = 12", "12", {}) == 1.0  # the last number is the answer
    assert arithmetic("12, or maybe 13", "12", {}) == 0.0
    assert arithmetic("-3", "-3", {}) == 1.0
    assert arithmetic("twelve", "12", {}) == 0.0
    exact = resolve("exact_match")
    assert exact("  Paris \n", "Paris", {}) == 1.0
    assert exact("paris", "Paris", {}) == 0.0
    assert exact("b", ["a", "b"], {}) == 1.0


def test_countdown_rule():
    row = make_rows("countdown", 1, seed=0)[0]
    truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["solution"]
    countdown = resolve("countdown")
    assert countdown(f"I think <answer>{solution}</answer>", truth, {})["score"] == 1.0
    assert countdown("<answer>1 + 1</answer>", truth, {})["score"] == 0.1
    assert countdown("<answer>__import__('os')</answer>", truth, {})["score"] == 0.1
    assert countdown("no tags", truth, {})["score"] == 0.0
    # Using a number twice is wrong even when the value is right.
    a = truth["numbers"][0]
    doubled = f"{solution} + {a} - {a}"
    assert countdown(f"<answer>{doubled}</answer>", truth, {})["correct"] == 0.0


def test_unknown_data_source_fails_loudly():
    with pytest.raises(KeyError, match="no reward function for data_source `my_data`"):
        resolve("my_data")
    assert resolve("my_data", {"my_data": "exact_match"})("x", "x", {}) == 1.0
    assert resolve("openai/gsm8k") is resolve("math")


def test_runner_scores_and_turns_failures_into_errors():
    async def main():
        cfg = RewardConfig(num_workers=2, timeout_s=3.0)
        with RewardRunner(
            cfg,
            sources={
                "slow": "reward_plugins:sleeps",
                "bad": "reward_plugins:raises",
                "dies": "reward_plugins:dies",
                "nan": "reward_plugins:not_a_number",
                "parts": "reward_plugins:components",
            },
        ) as runner:
            with pytest.raises(KeyError):
                runner.check(["arithmetic", "nope"])
            good, math_ok, slow, bad, parts = await asyncio.gather(
                runner.score("arithmetic", "7", "7", {}),
                runner.score("math", "so the answer is \\boxed{\\frac{1}{2}}", "0.5", {}),
                runner.score("slow", "x", "x", {"sleep_s": 60}),
                runner.score("bad", "x", "x", {}),
                runner.score("parts", "x", "x", {}),
            )
            assert good.score == 1.0 and not good.error
            assert math_ok.score == 1.0 and not math_ok.error
            assert slow.score == 0.0 and slow.error == "timeout"
            assert bad.score == 0.0 and "reward function exploded" in bad.error
            assert parts.score == 0.5 and parts.components == {"format": 1.0}
            dead = await runner.score("dies", "x", "x", {})
            assert dead.score == 0.0 and dead.error == "worker died"
            nan = await runner.score("nan", "x", "x", {})
            assert nan.score == 0.0 and "needs a `score` entry" in nan.error
            unknown = await runner.score("nope", "x", "x", {})
            assert unknown.score == 0.0 and "no reward function" in unknown.error
            # The runner still works after a timeout and a dead worker replaced its pool.
            assert (await runner.score("arithmetic", "8", "8", {})).score == 1.0
            assert runner.timeouts == 1 and runner.errors == 5

    asyncio.run(main())
