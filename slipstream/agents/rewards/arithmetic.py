"""Arithmetic reward: 1 when the last integer in the reply is the ground truth (the quickstart task).

The last number, as the flexible answer extraction of GSM8K-style rewards takes it: a reply that restates
the question before answering ("13 + 14 = 27") is right, one that answers and then wanders on to another
number is not. A small instruct model restates most sums before answering, so the first integer in its reply
is the right sum in about 2% of replies, the last one in about 13% (SmolLM2-135M-Instruct at temperature 1);
at 2% a step of 32 samples often has no correct reply, and GRPO learns nothing from a batch of equal rewards.
"""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")


def arithmetic_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    numbers = _INT.findall(response)
    if not numbers:
        return 0.0
    return 1.0 if int(numbers[-1]) == int(str(ground_truth).strip()) else 0.0
