"""Tools for the multi-turn ``tool`` agent loop, chosen by name in ``agent.tools``.

To add a tool: subclass :class:`~slipstream.agents.tools.base.Tool` in a small module here (name,
description, JSON-schema parameters, ``async call(arguments) -> str``, constructor taking the
:class:`~slipstream.agents.config.AgentConfig`) and add it to :data:`TOOLS`. A user's own tool needs no
edit here: an ``agent.tools`` entry ``package.module:ClassName`` names any ``Tool`` subclass; the model
calls it by its ``name`` attribute (``slipstream/agents/examples/plugins.py`` has one).

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
from slipstream.utils.registry import Registry

TOOLS: Registry[type[Tool]] = Registry("tool", "agent.tools", plugins=True, base=Tool)
TOOLS.add("python", PythonTool)
TOOLS.add("calculator", CalculatorTool)


def tool_class(name: str) -> type[Tool]:
    """The tool class ``name`` names: a key of :data:`TOOLS` or ``package.module:ClassName``. Raises
    a ValueError naming ``agent.tools`` (see :mod:`slipstream.utils.registry`)."""
    return TOOLS.get(name)


def make_tools(names: list[str], cfg: AgentConfig | None = None) -> dict[str, Tool]:
    """Instantiate the named tools, in order, keyed by the name the model calls them by; an unknown name
    raises ValueError listing the known ones, and so do two tools of one name."""
    cfg = cfg or AgentConfig()
    tools: dict[str, Tool] = {}
    for name in names:
        cls = tool_class(name)
        called = getattr(cls, "name", "") or name
        if called in tools:
            raise ValueError(f"agent.tools: two tools are called `{called}` (the second is `{name}`)")
        tools[called] = cls(cfg)
    return tools


__all__ = ["TOOLS", "Tool", "ToolArgumentError", "make_tools", "tool_class"]
