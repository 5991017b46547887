"""Agent loops against a scripted client: exact token ids, loss masks, limits, and bad tool calls."""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_fakes import ScriptedClient

from slipstream.agents.chat import ChatRenderer
from slipstream.agents.config import AgentConfig
from slipstream.agents.data import Sample
from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.agents.tool_parser import parse_tool_calls
from slipstream.utils.tiny_models import make_tiny_tokenizer

SAMPLE = Sample(
    index=0,
    messages=[{"role": "user", "content": "What is 6 * 7?"}],
    data_source="arithmetic",
    ground_truth="42",
)
PARAMS = SamplingParams(max_new_tokens=200, temperature=0.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def run(loop, sample=SAMPLE, params=PARAMS, uid="g0-0"):
    out = asyncio.run(loop.run(sample, params, uid=uid))
    out.validate()
    return out


def test_single_turn_keeps_server_tokens(tok):
    weird = [5, 300 - 40, 17, 256]  # ids that do not round-trip through text; kept as they are
    client = ScriptedClient(
        tok,
        [
            lambda ids, sp: GenerateOutput(
                output_ids=weird, logprobs=[-1.0] * 4, versions=[2, 2, 3, 3], finish_reason="stop"
            )
        ],
    )
    loop = make_agent_loop(AgentConfig(name="single_turn"), client, tok)
    out = run(loop)
    assert out.response_ids == weird and out.loss_mask == [1] * 4 and out.versions == [2, 2, 3, 3]
    assert out.prompt_ids == ChatRenderer(tok).prompt_ids(SAMPLE.messages)
    assert client.requests[0][2] == "g0-0"
    # Generation also stops at the template's end-of-turn token, whatever the model's own EOS is.
    assert tok.convert_tokens_to_ids("<|im_end|>") in client.requests[0][1].stop_token_ids


def test_single_turn_renders_a_groups_prompt_once(tok):
    """A group's episodes share one Sample object: the chat template runs once for all of them, and each
    episode still gets its own copy of the ids."""
    client = ScriptedClient(tok, ["4", "5", "6", "7"])
    loop = make_agent_loop(AgentConfig(name="single_turn"), client, tok)
    rendered = []
    render = loop.renderer.prompt_ids
    loop.renderer.prompt_ids = lambda messages: rendered.append(messages) or render(messages)
    other = Sample(
        index=1, messages=[{"role": "user", "content": "What is 2 + 2?"}], data_source="arithmetic"
    )
    outs = [run(loop, SAMPLE), run(loop, SAMPLE), run(loop, SAMPLE), run(loop, other)]
    assert len(rendered) == 2  # SAMPLE once, then the other prompt
    assert outs[0].prompt_ids == outs[1].prompt_ids == ChatRenderer(tok).prompt_ids(SAMPLE.messages)
    assert outs[0].prompt_ids is not outs[1].prompt_ids
    assert outs[3].prompt_ids == ChatRenderer(tok).prompt_ids(other.messages)


def test_tool_episode_masks_tool_tokens_and_matches_template(tok):
    cfg = AgentConfig(name="tool", tools=["calculator"], max_turns=4)
    client = ScriptedClient(
        tok, ["Let me compute. " + call("calculator", expression="6 * 7"), "The answer is 42."], version=3
    )
    loop = make_agent_loop(cfg, client, tok)
    out = run(loop)
    assert out.finish_reason == "stop" and out.num_turns == 2
    assert out.response_text == "The answer is 42."
    assert out.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}

    # The whole episode equals the chat template's rendering of the conversation, token for token.
    renderer = ChatRenderer(tok, tools=[t.schema() for t in loop.tools.values()])
    messages = [
        *SAMPLE.messages,
        {"role": "assistant", "content": "Let me compute. " + call("calculator", expression="6 * 7")},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    rendered = renderer.encode(renderer.render(messages, add_generation_prompt=False))
    assert out.prompt_ids + out.response_ids == rendered[: len(out.prompt_ids) + len(out.response_ids)]

    # Tool tokens: loss mask 0, logprob 0, version of the turn before; generated tokens: mask 1.
    first_len = len(tok.encode("Let me compute. " + call("calculator", expression="6 * 7"))) + 1
    second_request = client.requests[1][0]
    delta = second_request[len(out.prompt_ids) + first_len :]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(delta)
    mask = out.loss_mask
    assert mask == [1] * first_len + [0] * len(delta) + [1] * (len(out.response_ids) - first_len - len(delta))
    assert all(lp == 0.0 for lp, m in zip(out.logprobs, mask, strict=True) if m == 0)
    assert set(out.versions) == {3}
    # The second request continued from the exact ids of the first turn.
    assert second_request[: len(out.prompt_ids) + first_len] == out.prompt_ids + out.response_ids[:first_len]


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("<tool_call>{not json}</tool_call>", "Error: the tool call is not valid JSON"),
        (call("shell", cmd="ls"), "Error: unknown tool `shell`; available tools: calculator"),
        (
            call("calculator", expr="1"),
            "Error: bad arguments for `calculator`: missing argument `expression`",
        ),
        ('<tool_call>{"name": "calculator", "arguments": "{bad"}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"name": "calculator"', "has no closing </tool_call>"),
        (call("calculator", expression="import os"), "Error: not an expression"),
    ],
)
def test_bad_tool_calls_are_answered_not_raised(tok, reply, expected):
    cfg = AgentConfig(name="tool", tools=["calculator"])
    client = ScriptedClient(tok, [reply, "ok"])
    out = run(make_agent_loop(cfg, client, tok))
    assert out.finish_reason == "stop" and out.num_turns == 2
    second_prompt = tok.decode(client.requests[1][0])
    assert expected in second_prompt


def test_turn_and_token_limits(tok):
    cfg = AgentConfig(name="tool", tools=["calculator"], max_turns=2)
    client = ScriptedClient(tok, [call("calculator", expression="1+1")] * 3)
    out = run(make_agent_loop(cfg, client, tok))
    assert out.num_turns == 2 and out.finish_reason == "length" and len(client.requests) == 2
    assert out.loss_mask[-1] == 1  # the episode ends on the model's own tokens

    prompt_len = len(make_agent_loop(cfg, client, tok).prompt_ids(SAMPLE))
    cfg = AgentConfig(name="tool", tools=["calculator"], max_turns=8, max_total_tokens=prompt_len + 120)
    client = ScriptedClient(tok, [call("calculator", expression="1+1")] * 8)
    out = run(make_agent_loop(cfg, client, tok))
    assert out.finish_reason == "length"
    assert len(out.prompt_ids) + len(out.response_ids) <= cfg.max_total_tokens
    # Every request asked for no more than what was left of the total budget.
    for ids, sp, _ in client.requests:
        assert len(ids) + sp.max_new_tokens <= cfg.max_total_tokens


def test_generation_stopped_on_close_tag_gets_an_end_of_turn_token(tok):
    cfg = AgentConfig(name="tool", tools=["calculator"])
    client = ScriptedClient(tok, [call("calculator", expression="2+2"), "4"], eot=False)
    out = run(make_agent_loop(cfg, client, tok))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    first = len(tok.encode(call("calculator", expression="2+2")))
    assert out.response_ids[first] == eot and out.loss_mask[first] == 0


def test_parse_tool_calls_accepts_openai_string_arguments():
    calls = parse_tool_calls(
        'x <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call> y'
        '<tool_call> {"name": "g"} </tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [("f", {"a": 1}, ""), ("g", {}, "")]


def test_unknown_agent_loop_name(tok):
    with pytest.raises(ValueError, match="unknown agent loop `react`; known loops: single_turn, tool"):
        make_agent_loop(AgentConfig(name="react"), ScriptedClient(tok, []), tok)
