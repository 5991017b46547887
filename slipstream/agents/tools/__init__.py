"""Tools for the multi-turn ``tool`` agent loop, chosen by name in ``agent.tools``.

To add a tool: subclass :class:`~slipstream.agents.tools.base.Tool` in a small module here (name,
description, JSON-schema parameters, ``async call(arguments) -> str``, constructor taking the
:class:`~slipstream.agents.config.AgentConfig`) and add it to :data:`TOOLS`.

Worked example::

    tools = make_tools(["python", "calculator"], AgentConfig())
    [t.schema()["function"]["name"] for t in tools.values()]   # ["python", "calculator"]
    await tools["calculator"].call({"expression": "6 * 7"})     # "42"
"""

from __future__ import annotations

from slipstream.agents.config import AgentConfig
from slipstream.agents.tools.base import Tool, ToolArgumentError
from slipstream.agents.tools.calculator import CalculatorTool
from slipstream.agents.tools.python import PythonTool

TOOLS: dict[str, type[Tool]] = {
    "python": PythonTool,
    "calculator": CalculatorTool,
}


def make_tools(names: list[str], cfg: AgentConfig | None = None) -> dict[str, Tool]:
    """Instantiate the named tools, in order; an unknown name raises ValueError listing the known ones."""
    cfg = cfg or AgentConfig()
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in TOOLS:
            raise ValueError(f"agent.tools: unknown tool `{name}`; known tools: {', '.join(TOOLS)}")
        tools[name] = TOOLS[name](cfg)
    return tools


__all__ = ["TOOLS", "Tool", "ToolArgumentError", "make_tools"]
