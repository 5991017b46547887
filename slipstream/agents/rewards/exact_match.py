"""Exact-match reward: 1 when the reply, stripped and with whitespace runs collapsed, equals the answer.

A reply may end with the end-of-turn text some templates leave in a decoded response; only surrounding
whitespace is ignored, case and punctuation count.
"""

from __future__ import annotations

from typing import Any


def _normalise(text: str) -> str:
    return " ".join(text.split())


def exact_match_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    answers = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    reply = _normalise(response)
    return 1.0 if any(reply == _normalise(str(a)) for a in answers) else 0.0
