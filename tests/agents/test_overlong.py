"""Overlong reward shaping: DAPO's linear penalty over the last buffer tokens before the response limit."""

from __future__ import annotations

import pytest

from slipstream.agents.rewards import resolve
from slipstream.agents.rewards.overlong import overlong_penalty, shape
from slipstream.agents.rewards.runner import RewardResult


def penalty(length: int, *, limit: int = 28672, buffer: int = 4096, factor: float = 1.0) -> float:
    return overlong_penalty(length, max_response_len=limit, buffer_len=buffer, penalty_factor=factor)


def test_no_penalty_up_to_the_start_of_the_buffer():
    assert penalty(0) == 0.0
    assert penalty(28672 - 4096 - 1) == 0.0
    assert penalty(28672 - 4096) == 0.0  # exactly at the start: still free


def test_linear_inside_the_buffer_and_the_full_factor_at_the_limit():
    assert penalty(28672 - 4096 + 1) == pytest.approx(-1 / 4096)
    assert penalty(28672 - 2048) == pytest.approx(-0.5)
    assert penalty(28672 - 1) == pytest.approx(-4095 / 4096)
    assert penalty(28672) == pytest.approx(-1.0)
    assert penalty(28672 - 2048, factor=0.5) == pytest.approx(-0.25)
    assert penalty(18, limit=20, buffer=4) == pytest.approx(-0.5)


def test_bounded_past_the_limit_and_off_without_a_buffer():
    assert penalty(40000) == pytest.approx(-1.0)  # a multi-turn response with tool output can be longer
    assert penalty(28672, buffer=0) == 0.0
    assert penalty(28672, factor=0.0) == 0.0
    with pytest.raises(ValueError, match="longer than the response limit"):
        penalty(10, limit=8, buffer=16)


def test_shape_adds_the_penalty_and_keeps_the_task_score():
    base = RewardResult(score=1.0, components={"acc": 1.0})
    shaped = shape(base, 20, max_response_len=20, buffer_len=4, penalty_factor=1.0)
    assert shaped.score == pytest.approx(0.0)
    assert shaped.components == {"acc": 1.0, "task_score": 1.0, "overlong_penalty": -1.0}
    assert shape(base, 20, max_response_len=20, buffer_len=0, penalty_factor=1.0) is base
    wrong = shape(RewardResult(score=-1.0), 16, max_response_len=20, buffer_len=4, penalty_factor=1.0)
    assert wrong.score == -1.0 and wrong.components["overlong_penalty"] == 0.0


def test_math_signed_scores_one_or_minus_one_and_keeps_accuracy():
    signed = resolve("math_signed")
    assert signed("so \\boxed{\\frac{1}{2}}", "0.5", {}) == {"score": 1.0, "acc": 1.0}
    assert signed("so \\boxed{3}", "0.5", {}) == {"score": -1.0, "acc": 0.0}
