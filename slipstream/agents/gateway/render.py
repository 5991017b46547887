"""Chat-template rendering for the gateway: OpenAI messages and tools in, token ids out; replies parsed back.

The gateway renders with the served model's own chat template (:class:`~slipstream.agents.chat.ChatRenderer`),
so the ids it sends are the ids the model is trained on. Two adaptations keep any template usable:

* a template that does not render ``tools`` gets them described in the system message, with the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention the reply parser reads;
* a template that does not render an assistant message's ``tool_calls`` gets them as that text in the
  message's content (only a fresh rendering needs this: a continued segment reuses the recorded ids).

Replies: ``<tool_call>`` blocks become OpenAI ``tool_calls`` (ids ``call_<hex>``, arguments as a JSON
string) and the text before them the ``content``; a reply with a malformed block is returned as plain text,
as OpenAI servers do when their tool parser fails. This is the format of every model in ``configs/`` and the
recipes: Qwen2.5(-Math) and Qwen3 render and emit ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``
(Qwen3 after a ``<think>`` block), and SmolLM2's template renders no tools, so it gets the description above.

``tool_choice`` (:func:`tool_prefill`): ``none`` parses no call, ``auto`` any, ``required`` forces the reply
to open with ``<tool_call>`` and a named function with ``<tool_call>{"name": "<name>", "arguments": ``; the
forced text is inserted tokens (loss_mask 0), the model generates the rest. There is no constrained
decoding: a forced reply that still does not parse comes back as text.

Image parts (gateway/images.py) reach the template as ``{"type": "image"}`` parts, which vision-language
templates (Qwen2-VL's and the tiny test model's) render as one ``<|vision_start|><|image_pad|><|vision_end|>``
each; the server expands each pad to the image's tokens. A message without images keeps its text parts
joined, as text-only templates expect.
"""

from __future__ import annotations

import json
import secrets
import threading
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
    """Renders requests for one tokenizer; keeps a :class:`ChatRenderer` per distinct tools list. Thread-safe:
    the gateway renders in worker threads, one request per session at a time but sessions in parallel."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        source = template_source(tokenizer)
        self.native_tools = "tools" in source
        self.native_tool_calls = "tool_calls" in source
        self._renderers: dict[str, ChatRenderer] = {}
        self._lock = threading.Lock()  # guards _renderers
        self.stop_ids = ChatRenderer(tokenizer).stop_ids

    def renderer(self, tools_key: str, tools: list[dict[str, Any]] | None) -> ChatRenderer:
        with self._lock:
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
            if out and out[0]["role"] == "system" and isinstance(out[0]["content"], list):  # with images
                out[0] = {**out[0], "content": [*out[0]["content"], {"type": "text", "text": f"\n\n{text}"}]}
            elif out and out[0]["role"] == "system":
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
        if isinstance(content, list) and any(p.get("type") == "image_url" for p in content):
            # image parts stay parts, without their bytes: the template renders one image pad for each
            content = [p if p.get("type") == "text" else {"type": "image"} for p in content]
        elif isinstance(content, list):
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


def cut_at_stop(tokenizer: Any, output_ids: list[int], stops: list[str]) -> int:
    """How many of ``output_ids`` to keep: up to the token that completes the first of the ``stop`` strings
    in the decoded reply (all of them when none occurs). The tokens after it were sampled but never shown to
    the harness, so the record ends there too."""
    if not stops:
        return len(output_ids)
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if not ends:
        return len(output_ids)
    end = min(ends)
    lo, hi = 1, len(output_ids)  # the shortest prefix whose text reaches `end`
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(output_ids[:mid], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _before_stop(text: str, stops: list[str]) -> str:
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def parse_reply(
    tokenizer: Any,
    output_ids: list[int],
    stop_ids: set[int],
    with_tools: bool,
    *,
    prefill: list[int] = (),  # type: ignore[assignment]
    stops: list[str] = (),  # type: ignore[assignment]
) -> dict:
    """The assistant message for ``prefill + output_ids`` (the forced start of a ``tool_choice`` reply and
    what the model generated after it): ``content`` (up to the first ``stop`` string, which is left out, as
    OpenAI does) and, when tools may be called and the reply calls them well-formed, ``tool_calls``."""
    ids = list(prefill) + list(output_ids)
    ids = ids[:-1] if ids and ids[-1] in stop_ids else ids
    raw = _before_stop(tokenizer.decode(ids, skip_special_tokens=False), list(stops))
    plain = _before_stop(tokenizer.decode(ids, skip_special_tokens=True), list(stops))
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


def tool_prefill(tool_choice: Any) -> str:
    """The text a reply is forced to start with for ``tool_choice`` ("" for none, auto or absent)."""
    if tool_choice == "required":
        return OPEN
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name", "")
        return OPEN + '{"name": ' + json.dumps(name) + ', "arguments": '
    return ""
