"""Chat-template rendering for the gateway: OpenAI messages and tools in, token ids out; replies parsed back.

The gateway renders with the served model's own chat template (:class:`~slipstream.agents.chat.ChatRenderer`),
so the ids it sends are the ids the model is trained on. Two adaptations keep any template usable:

* a template that does not render ``tools`` gets them described in the system message, with the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention the reply parser reads;
* a template that does not render an assistant message's ``tool_calls`` gets them as that text in the
  message's content (only a fresh rendering needs this: a continued segment reuses the recorded ids).

Replies: ``<tool_call>`` blocks become OpenAI ``tool_calls`` (ids ``call_<hex>``, arguments as a JSON
string) and the text before them the ``content``; a reply with a malformed block is returned as plain text,
as OpenAI servers do when their tool parser fails.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from slipstream.agents.chat import ChatRenderer
from slipstream.agents.tool_parser import OPEN, parse_tool_calls

_MAX_RENDERERS = 64


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else " ".join(str(v) for v in template.values())


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
    return (
        "You can call these tools:\n"
        f"{lines}\n"
        "To call one, reply with "
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call> '
        "and wait for its result."
    )


class GatewayRenderer:
    """Renders requests for one tokenizer; keeps a :class:`ChatRenderer` per distinct tools list."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        source = template_source(tokenizer)
        self.native_tools = "tools" in source
        self.native_tool_calls = "tool_calls" in source
        self._renderers: dict[str, ChatRenderer] = {}
        self.stop_ids = ChatRenderer(tokenizer).stop_ids

    def renderer(self, tools_key: str, tools: list[dict[str, Any]] | None) -> ChatRenderer:
        r = self._renderers.get(tools_key)
        if r is None:
            if len(self._renderers) >= _MAX_RENDERERS:
                self._renderers.pop(next(iter(self._renderers)))
            r = ChatRenderer(self.tokenizer, tools=tools if self.native_tools else None)
            self._renderers[tools_key] = r
        return r

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict]:
        """Messages the template can render: text content, tool calls as text where it cannot render
        them, and (for templates without tools) the tools described in the system message."""
        out = [self._message(m) for m in messages]
        if tools and not self.native_tools:
            text = tools_system_text(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def full_ids(self, messages, tools, tools_key: str) -> list[int]:
        return self.renderer(tools_key, tools).prompt_ids(self.prepare(messages, tools))

    def delta_ids(self, messages, tools, tools_key: str, ended_turn: bool) -> list[int]:
        """Tokens that follow the recorded assistant turn and carry ``messages`` (raises ValueError where the
        template renders earlier turns differently once these follow)."""
        new = [self._message(m) for m in messages]
        return self.renderer(tools_key, tools).tool_turn_ids(new, ended_turn=ended_turn)

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out = {k: v for k, v in message.items() if k not in ("content", "tool_calls")}
        out["content"] = content or ""
        calls = message.get("tool_calls") or []
        if calls and self.native_tool_calls:
            out["tool_calls"] = [_template_call(c) for c in calls]
        elif calls:
            text = "".join(
                OPEN + json.dumps({"name": c["name"], "arguments": c["arguments"]}) + "</tool_call>"
                for c in (_template_call(c)["function"] for c in calls)
            )
            out["content"] = f"{out['content']}{text}"
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": {"name": fn.get("name", ""), "arguments": args}}


def parse_reply(tokenizer: Any, output_ids: list[int], stop_ids: set[int], with_tools: bool) -> dict:
    """The assistant message for ``output_ids``: ``content`` and, when the request offered tools and the
    reply calls them well-formed, ``tool_calls``."""
    ids = output_ids[:-1] if output_ids and output_ids[-1] in stop_ids else output_ids
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    message: dict[str, Any] = {"role": "assistant", "content": plain}
    if not with_tools or OPEN not in raw:
        return message
    calls = parse_tool_calls(raw)
    if not calls or any(c.error for c in calls):
        return message
    head = raw[: raw.index(OPEN)].strip()
    message["content"] = head or None
    message["tool_calls"] = [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return message
