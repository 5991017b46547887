"""Countdown reward (TinyZero's rule): 1 for a correct equation, 0.1 for a well-formed wrong one, else 0.

The last ``<answer>...</answer>`` of the reply must use each given number exactly once and evaluate to the
target. It is evaluated with :func:`slipstream.agents.expr.safe_eval`, never as Python.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from slipstream.agents.expr import ExpressionError, numbers_in, safe_eval

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
FORMAT_SCORE = 0.1


def countdown_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> dict[str, float]:
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    answers = _ANSWER.findall(response)
    if not answers:
        return {"score": 0.0, "format": 0.0, "correct": 0.0}
    equation = answers[-1].strip().split("=")[0]
    try:
        used = numbers_in(equation)
        value = safe_eval(equation)
    except ExpressionError:
        return {"score": FORMAT_SCORE, "format": 1.0, "correct": 0.0}
    correct = Counter(used) == Counter(numbers) and abs(value - target) < 1e-6
    return {"score": 1.0 if correct else FORMAT_SCORE, "format": 1.0, "correct": float(correct)}
