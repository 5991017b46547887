"""The tool interface: an OpenAI function schema the chat template renders, and an async call.

A tool never raises to the agent loop for anything the model did wrong: bad arguments, a failing
computation or a timeout come back as text the model reads in its next turn (``Error: ...``). Only a
bug in the tool itself escapes, and the agent loop turns even that into an error message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar


def truncate_middle(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and its tail (where a traceback's
    error is), with a note of how much was cut in between."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[len(text) - tail :]}"


class ToolArgumentError(ValueError):
    """The model called a tool with arguments that do not match its schema."""


class Tool(ABC):
    """One tool the model may call: ``name``, ``description``, JSON-schema ``parameters`` and :meth:`call`."""

    name: ClassVar[str]
    description: ClassVar[str]
    # JSON schema of the arguments object (OpenAI function-calling format).
    parameters: ClassVar[dict[str, Any]]

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema passed to the chat template as ``tools=[...]``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Raise :class:`ToolArgumentError` for missing, unknown or mistyped arguments (flat schemas)."""
        properties = self.parameters.get("properties", {})
        for key in self.parameters.get("required", []):
            if key not in arguments:
                raise ToolArgumentError(f"missing argument `{key}`")
        for key, value in arguments.items():
            if key not in properties:
                raise ToolArgumentError(f"unknown argument `{key}`; expected {', '.join(properties)}")
            expected = properties[key].get("type")
            if expected == "string" and not isinstance(value, str):
                raise ToolArgumentError(f"argument `{key}` must be a string, got {type(value).__name__}")

    @abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool; return the text the model sees."""
