"""Python tool: runs the model's code in the sandbox (agents/tools/sandbox.py) and returns its output.

Building the tool checks that the sandbox's boundary can be built on this machine and raises
:class:`~slipstream.agents.tools.sandbox.SandboxUnavailable` (what is missing, how to enable it) if not,
so a run without isolation stops at start instead of running a policy's code unconfined.
"""

from __future__ import annotations

from typing import Any

from slipstream.agents.config import AgentConfig
from slipstream.agents.tools.base import Tool
from slipstream.agents.tools.sandbox import SandboxLimits, require_sandbox, run_python
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class PythonTool(Tool):
    name = "python"
    description = (
        "Run a Python 3 program and return what it prints (stdout and stderr). No network; time and memory "
        "are limited; only /tmp (the working directory) is writable. Print the values you need."
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
        self.unsafe_no_isolation = cfg.sandbox_unsafe_no_isolation
        if self.unsafe_no_isolation:
            log.warning(
                "agent.sandbox_unsafe_no_isolation is set: the python tool runs code WITHOUT isolation "
                "(limits only); use it for trusted code only"
            )
        else:
            require_sandbox()

    async def call(self, arguments: dict[str, Any]) -> str:
        self.check_arguments(arguments)
        result = await run_python(
            arguments["code"], self.limits, unsafe_no_isolation=self.unsafe_no_isolation
        )
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
