"""What scoring one response gives, however it was scored (a function in a worker, a served model)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec


class RewardResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The score to train on, its named parts, and why it is 0 when the function failed."""

    score: float
    components: dict[str, float] = {}
    # Empty when the function returned normally; otherwise "timeout", "worker died" or the exception text.
    error: str = ""


def normalise(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's value (a number, or a dict with ``score`` and named components) as
    ``(score, components)``; ValueError for anything else or a score that is not finite."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"a reward dict needs a `score` entry, got keys {sorted(value)}")
        components = {str(k): float(v) for k, v in value.items() if k != "score"}
        score = float(value["score"])
    else:
        score, components = float(value), {}
    if not math.isfinite(score):
        raise ValueError(f"reward is {score}, not a finite number")
    return score, components
