"""The tools as the agent loop sees them: limits come back as text, bad input is an answer (the sandbox's
own tests are in test_sandbox.py)."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.agents.config import AgentConfig
from slipstream.agents.expr import ExpressionError, safe_eval
from slipstream.agents.tools import make_tools
from slipstream.agents.tools.sandbox import sandbox_problem


def test_python_tool_reports_limits_as_text():
    if sandbox_problem() is not None:
        pytest.skip(f"the sandbox's isolation is unavailable on this machine: {sandbox_problem()}")
    tools = make_tools(["python"], AgentConfig(sandbox_cpu_s=1.0, sandbox_wall_s=5.0))
    reply = asyncio.run(tools["python"].call({"code": "while True: pass"}))
    assert reply.startswith("Error: the program used more than 1s of CPU time")


def test_calculator_is_safe():
    calc = make_tools(["calculator"])["calculator"]
    assert asyncio.run(calc.call({"expression": "(3 + 4) * 2 ** 3"})) == "56"
    assert asyncio.run(calc.call({"expression": "sqrt(16) / 8"})) == "0.5"
    assert asyncio.run(calc.call({"expression": "1 / 0"})) == "Error: division by zero"
    assert asyncio.run(calc.call({"expression": "__import__('os').system('true')"})).startswith(
        "Error: unsupported syntax"
    )
    with pytest.raises(ExpressionError, match="exponent"):
        safe_eval("9 ** 9 ** 9")
    with pytest.raises(ExpressionError, match="unsupported syntax: Attribute"):
        safe_eval("(1).__class__")


def test_unknown_tool_name_fails_at_config_time():
    with pytest.raises(ValueError, match="unknown tool `shell`; known tools: python, calculator"):
        make_tools(["shell"])
