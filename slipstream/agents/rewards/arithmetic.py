"""Arithmetic reward: 1 when the first integer in the reply is the ground truth (the quickstart task)."""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")


def arithmetic_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    match = _INT.search(response)
    if match is None:
        return 0.0
    return 1.0 if int(match.group()) == int(str(ground_truth).strip()) else 0.0
