"""Math reward with math-verify: the reply's final answer (boxed, LaTeX or plain) equals the ground truth.

math-verify parses both sides to sympy and compares them symbolically (``0.5`` equals ``\\frac{1}{2}``).
Its own timeouts use SIGALRM, which works here because reward functions run in the main thread of a
worker process; the runner's timeout stays the outer bound.
"""

from __future__ import annotations

from typing import Any


def _as_latex(answer: str) -> str:
    # A bare gold answer such as "42" or "\\frac{1}{2}" parses reliably once it is inside math delimiters.
    return answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"


def math_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    # Imported here: sympy takes most of a second to import, and only worker processes need it.
    from math_verify import parse, verify

    answers = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    predicted = parse(response)
    if not predicted:
        return 0.0
    for answer in answers:
        gold = parse(_as_latex(str(answer)))
        if gold and verify(gold, predicted):
            return 1.0
    return 0.0


def math_signed_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> dict[str, float]:
    """DAPO's scale: 1 for a right answer, -1 otherwise; ``acc`` (1 or 0) keeps the verdict itself."""
    acc = math_reward(response, ground_truth, extra_info)
    return {"score": 1.0 if acc else -1.0, "acc": acc}
