"""Parse Hermes/Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A model in training writes broken calls all the time. Parsing never raises: each call comes back either
with its name and arguments or with an ``error`` the agent loop returns to the model as the tool's answer,
so the model can learn from it and the episode goes on.

Worked example::

    parse_tool_calls('Let me check. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
                     '</tool_call>')
    # [ToolCall(name="calculator", arguments={"expression": "6*7"}, error="")]
    parse_tool_calls("<tool_call>{not json}</tool_call>")
    # [ToolCall(name="", arguments={}, error="the tool call is not valid JSON: ...")]
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


class ToolCall(msgspec.Struct, kw_only=True):
    name: str = ""
    arguments: dict[str, Any] = {}
    # Non-empty when the call could not be understood; the text says why, for the model to read.
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order; an unclosed last block is a malformed call."""
    calls = [_parse_one(body) for body in _CALL.findall(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text
    if OPEN in tail:
        calls.append(ToolCall(error=f"the tool call has no closing {CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCall(error=f"the tool call is not valid JSON: {err.msg} at position {err.pos}")
    if not isinstance(obj, dict):
        return ToolCall(error='the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call needs a "name" string')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCall(name=name, error=f'"arguments" is a string but not valid JSON: {err.msg}')
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error='"arguments" must be a JSON object')
    return ToolCall(name=name, arguments=arguments)
