"""Reply parsing of the gateway, without a server: the tool-call format of the models in configs/ and the
recipes (Qwen2.5, Qwen3: `<tool_call>` blocks holding JSON, after a `<think>` block for Qwen3; SmolLM2 gets
the same format described), the forced openings of `tool_choice`, and `stop` strings."""

from __future__ import annotations

import json

import pytest

from slipstream.agents.gateway.render import cut_at_stop, parse_reply, tool_prefill


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("reply", "content", "calls"),
    [
        # Qwen2.5 / Qwen2.5-Math (their template's own instructions: one JSON object per block, on its own line)
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>', None,
         [("calculator", {"expression": "6*7"})]),
        # Qwen3: thinking first, then two calls
        ("<think>\nI need both.\n</think>\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
         '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "<think>\nI need both.\n</think>",
         [("a", {"x": 1}), ("b", {})]),
        # the described format (SmolLM2's template renders no tools), arguments as a JSON string
        ('Let me check. <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>',
         "Let me check.", [("calculator", {"expression": "1+1"})]),
    ],
)  # fmt: skip
def test_tool_calls_of_the_configured_models_are_parsed(tok, reply, content, calls):
    message = parse_reply(tok, _ids(tok, reply), set(), True)
    assert message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == calls


def test_a_malformed_call_or_tool_choice_none_is_text(tok):
    broken = parse_reply(tok, _ids(tok, '<tool_call>{"name": oops}</tool_call>'), set(), True)
    assert "tool_calls" not in broken and "oops" in broken["content"]
    none = parse_reply(tok, _ids(tok, '<tool_call>{"name": "a", "arguments": {}}</tool_call>'), set(), False)
    assert "tool_calls" not in none


def test_forced_openings_complete_the_generated_call(tok):
    assert tool_prefill(None) == tool_prefill("auto") == tool_prefill("none") == ""
    named = tool_prefill({"type": "function", "function": {"name": "calculator"}})
    assert named == '<tool_call>{"name": "calculator", "arguments": '
    generated = _ids(tok, '{"expression": "2+2"}}</tool_call>')
    message = parse_reply(tok, generated, set(), True, prefill=_ids(tok, named))
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expression": "2+2"}
    required = parse_reply(tok, _ids(tok, '{"name": "x", "arguments": {}}</tool_call>'), set(), True,
                           prefill=_ids(tok, tool_prefill("required")))  # fmt: skip
    assert required["tool_calls"][0]["function"]["name"] == "x"


def test_stop_strings_cut_the_reply_and_its_tokens(tok):
    ids = _ids(tok, "one two STOP three")
    keep = cut_at_stop(tok, ids, ["STOP", "never"])
    assert tok.decode(ids[:keep]) == "one two STOP" and tok.decode(ids[: keep - 1]) == "one two STO"
    assert cut_at_stop(tok, ids, ["absent"]) == len(ids) and cut_at_stop(tok, ids, []) == len(ids)
    assert parse_reply(tok, ids[:keep], set(), False, stops=["STOP"])["content"] == "one two "
