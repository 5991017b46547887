"""Python tool: runs the model's code in the sandbox (agents/tools/sandbox.py) and returns its output."""

from __future__ import annotations

from typing import Any

from slipstream.agents.config import AgentConfig
from slipstream.agents.tools.base import Tool
from slipstream.agents.tools.sandbox import SandboxLimits, run_python


class PythonTool(Tool):
    name = "python"
    description = (
        "Run a Python 3 program and return what it prints (stdout and stderr). No network; time and memory "
        "are limited. Print the values you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program to run"}},
        "required": ["code"],
    }

    def __init__(self, cfg: AgentConfig | None = None) -> None:
        cfg = cfg or AgentConfig()
        self.limits = SandboxLimits(
            cpu_s=cfg.sandbox_cpu_s,
            wall_s=cfg.sandbox_wall_s,
            memory_mb=cfg.sandbox_memory_mb,
            max_output_chars=cfg.max_tool_output_chars,
        )

    async def call(self, arguments: dict[str, Any]) -> str:
        self.check_arguments(arguments)
        result = await run_python(arguments["code"], self.limits)
        notes = {
            "timeout": f"Error: the program ran longer than {self.limits.wall_s:g}s and was stopped.",
            "cpu_limit": f"Error: the program used more than {self.limits.cpu_s:g}s of CPU time and was stopped.",
            "output_limit": "Error: the program printed too much and was stopped.",
            "killed": f"Error: the program was killed (exit status {result.returncode}).",
        }
        note = notes.get(result.status)
        if note is None:
            return result.output
        return f"{result.output}\n{note}" if result.output else note
