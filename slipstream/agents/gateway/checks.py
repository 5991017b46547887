"""What the gateway refuses, and why, before a request costs a render, a token or a server's time.

A harness is untrusted input: a request may be malformed, huge or hostile, and it must cost only itself.
So, in order:

1. the body: at most ``MAX_REQUEST_BYTES`` (413), a JSON object (400) nesting at most ``MAX_JSON_DEPTH``
   levels (400; parsed and measured in a worker thread by :func:`parse_body`, so a hostile body never
   holds the event loop every session shares, and recursion never reaches a handler as a 500);
2. its text: at most ``max_total_tokens`` times the tokenizer's longest token in characters
   (:func:`check_text_size`, 400), since such a text certainly renders to more tokens than an episode may
   hold; only then is it rendered and tokenised (in a worker thread too);
3. its fields: ``n``, ``stop``, ``max_tokens``, ``stream``, messages (content parts text or images only),
   tools and ``tool_choice`` (400 naming the field), and a token-id prompt within the vocabulary
   (:func:`check_prompt_ids`, 400 naming the id: an id the model has no embedding for would fail on the
   server, not in the harness's request); the images are decoded and checked with the rendering
   (gateway/images.py).

Errors are OpenAI-style (``{"error": {"message", "type", "code"}}``, see :class:`GatewayError`).
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Nesting levels a body may have: serde_json's default limit; OpenAI tool schemas nest a handful.
MAX_JSON_DEPTH = 128
# Content part types a chat message may hold (gateway/images.py decodes the images).
PART_TYPES = ("text", "image_url")
# Most replies one request may ask for (`n`), and most stop strings (OpenAI's limit).
MAX_N = 16
MAX_STOPS = 4


class GatewayError(Exception):
    """An error answered to the harness with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


# ---------------------------------------------------------------------- the body
def parse_body(raw: bytes) -> tuple[dict[str, Any], int]:
    """The body as a JSON object and the characters of its strings (keys included). Runs in a worker thread:
    parsing and measuring take time proportional to the body, up to ``MAX_REQUEST_BYTES``."""
    too_deep = f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:  # the parser recurses per level; far past MAX_JSON_DEPTH anyway
        raise GatewayError(400, too_deep) from None
    except ValueError as err:
        raise GatewayError(400, f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    chars, depth = _measure(body)
    if depth > MAX_JSON_DEPTH:
        raise GatewayError(400, too_deep)
    return body, chars


def _measure(value: dict[str, Any]) -> tuple[int, int]:
    """Characters of the strings in ``value`` and its depth, without recursion (the point is to refuse
    bodies too deep to recurse through); stops descending past ``MAX_JSON_DEPTH``. An image part's URL is
    not text (its tokens are the image's, bounded by gateway/images.py), so it is not counted."""
    chars, deepest = 0, 1
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        if isinstance(node, dict):
            image = node.get("type") == "image_url"
            items = [*node, *(v for k, v in node.items() if not (image and k == "image_url"))]
        else:
            items = node
        for item in items:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1))
    return chars, deepest


def check_text_size(chars: int, max_tokens: int, longest_token: int) -> None:
    """Refuse a request whose text certainly has more than ``max_tokens`` tokens: no token covers more than
    ``longest_token`` characters, so this needs no tokenising."""
    limit = max_tokens * longest_token
    if chars > limit:
        raise GatewayError(
            400,
            f"the request carries {chars} characters of text, more than an episode's {max_tokens} tokens "
            f"(agent.max_total_tokens) can hold: at most {limit} characters ({longest_token} per token, "
            "this tokenizer's longest)",
            "context_length_exceeded",
        )


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise GatewayError(400, f"prompt contains token id {bad}, outside the vocabulary [0, {vocab_size})")


# ---------------------------------------------------------------------- the fields
def is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def check_common(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N):
        raise GatewayError(400, f"n must be an integer from 1 to {MAX_N}, got {n!r}")
    stop = body.get("stop")
    if stop is not None and not (
        (isinstance(stop, str) and stop)
        or (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(x, str) and x for x in stop))
    ):
        raise GatewayError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise GatewayError(400, f"{name} must be a positive integer, got {value!r}")
    if not isinstance(body.get("stream", False), bool):
        raise GatewayError(400, "stream must be true or false")


def check_completion(body: dict[str, Any], vocab_size: int) -> None:
    prompt = body.get("prompt")
    if is_ids(prompt):
        check_prompt_ids(prompt, vocab_size)
    elif not isinstance(prompt, str):
        raise GatewayError(400, "prompt must be a string or a list of token ids (one prompt)")


def check_chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise GatewayError(400, f"messages[{i}] needs a role, one of {list(ROLES)}")
        content, calls = m.get("content"), m.get("tool_calls")
        if content is None and not (m["role"] == "assistant" and calls):
            raise GatewayError(400, f"messages[{i}].content is missing")
        if content is not None and not isinstance(content, str | list):
            raise GatewayError(
                400, f"messages[{i}].content must be a string or a list of text and image parts"
            )
        if isinstance(content, list):
            check_parts(i, content)
        if calls is not None and not (
            isinstance(calls, list)
            and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)  # fmt: skip
        ):
            raise GatewayError(400, f"messages[{i}].tool_calls must be a list of function calls")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)
    ):
        raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}')
    check_tool_choice(body.get("tool_choice"), tools or [])


def part_url(part: dict[str, Any]) -> Any:
    """An image part's URL: ``{"image_url": {"url": ...}}``, or a bare string as some clients send it."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def check_parts(i: int, content: list[Any]) -> None:
    """Refuse a content list with anything but text and image parts (400 naming the part). The images
    themselves are decoded later, in a worker thread (gateway/images.py)."""
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise GatewayError(400, f"{where} must be a part of type {' or '.join(PART_TYPES)}, got {kind!r}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise GatewayError(400, f"{where} is a text part without a string `text`")
        if kind == "image_url" and not isinstance(part_url(part), str):
            raise GatewayError(
                400, f'{where} is an image part without {{"image_url": {{"url": "data:..."}}}}'
            )


def check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> None:
    if choice is None or choice in ("none", "auto"):
        return
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        if not names:
            raise GatewayError(400, 'tool_choice "required" needs tools')
        return
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(name, str)
    ):
        raise GatewayError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
        )
    if name not in names:
        raise GatewayError(400, f"tool_choice names {name!r}, which is not among the tools {names}")
