"""Overlong reward shaping (DAPO's soft overlong punishment): a length penalty added to the task reward.

A response cut at the length limit is usually unfinished, and scoring it 0 like a wrong answer teaches
the policy nothing about length. DAPO instead lowers the reward smoothly over the last ``buffer_len``
tokens before the limit: nothing up to ``max_response_len - buffer_len`` tokens, then a penalty that grows
linearly to ``penalty_factor`` at ``max_response_len``::

    penalty(L) = min(0, -(L - (max_response_len - buffer_len)) / buffer_len * penalty_factor)

so ``L = max_response_len - buffer_len`` costs 0, one token more costs ``penalty_factor / buffer_len``,
and ``L = max_response_len`` costs ``penalty_factor``. A multi-turn response (tool output included) can be
longer than ``max_response_len``; its penalty stops at ``penalty_factor`` so rewards stay bounded.

The rollouter applies it after scoring (:func:`shape`), keeping the task's own score as the component
``task_score`` and the penalty as ``overlong_penalty`` (both logged; dynamic sampling compares the task
score by default, as DAPO filters on accuracy, not on the shaped reward).

Worked example (max_response_len 20, buffer 4, factor 1)::

    overlong_penalty(16, max_response_len=20, buffer_len=4, penalty_factor=1.0)   # 0.0
    overlong_penalty(18, max_response_len=20, buffer_len=4, penalty_factor=1.0)   # -0.5
    overlong_penalty(20, max_response_len=20, buffer_len=4, penalty_factor=1.0)   # -1.0
"""

from __future__ import annotations

import msgspec

from slipstream.agents.rewards.runner import RewardResult


def overlong_penalty(
    response_len: int, *, max_response_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """The (non-positive) penalty for a response of ``response_len`` tokens; 0 when ``buffer_len`` is 0."""
    if buffer_len <= 0 or penalty_factor == 0:
        return 0.0
    if buffer_len > max_response_len:
        raise ValueError(
            f"overlong buffer ({buffer_len}) is longer than the response limit ({max_response_len})"
        )
    exceed = response_len - (max_response_len - buffer_len)
    return max(-penalty_factor, min(0.0, -exceed / buffer_len * penalty_factor))


def shape(
    result: RewardResult, response_len: int, *, max_response_len: int, buffer_len: int, penalty_factor: float
) -> RewardResult:
    """``result`` with the overlong penalty added to its score; unchanged when shaping is off."""
    if buffer_len <= 0:
        return result
    penalty = overlong_penalty(
        response_len, max_response_len=max_response_len, buffer_len=buffer_len, penalty_factor=penalty_factor
    )
    components = {**result.components, "task_score": result.score, "overlong_penalty": penalty}
    return msgspec.structs.replace(result, score=result.score + penalty, components=components)
