"""Calculator tool: evaluates arithmetic with :func:`slipstream.agents.expr.safe_eval` (never ``eval``)."""

from __future__ import annotations

from typing import Any

from slipstream.agents.expr import ExpressionError, safe_eval
from slipstream.agents.tools.base import Tool


class CalculatorTool(Tool):
    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with + - * / // % **, parentheses and sqrt, abs, round, floor, "
        "ceil, log, exp, sin, cos, tan, min, max, pi, e."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 3"}},
        "required": ["expression"],
    }

    def __init__(self, cfg: Any = None) -> None:
        pass

    async def call(self, arguments: dict[str, Any]) -> str:
        self.check_arguments(arguments)
        try:
            value = safe_eval(arguments["expression"])
        except ExpressionError as err:
            return f"Error: {err}"
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return str(value)
