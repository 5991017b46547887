"""The official `openai` client against the embedded server's /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import math

import httpx
import openai
import pytest


@pytest.fixture()
def oai(embedded_server):
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    yield client
    client.close()


def test_completions_with_token_ids_and_logprobs(oai):
    out = oai.completions.create(
        model="tiny", prompt=[10, 20, 30], max_tokens=6, logprobs=1, extra_body={"return_token_ids": True}
    )
    choice = out.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert 1 <= len(token_ids) <= 6
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.token_logprobs) == len(token_ids)
    assert all(lp <= 0 and math.isfinite(lp) for lp in choice.logprobs.token_logprobs)
    assert choice.model_extra["prompt_token_ids"] == [10, 20, 30]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == len(token_ids)
    assert out.model_extra["metadata"]["weight_version"] == "0"


def test_completions_text_prompt_and_n(oai):
    out = oai.completions.create(model="tiny", prompt="Hello", max_tokens=4, n=3, temperature=0.8)
    assert len(out.choices) == 3
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == len("Hello")  # the tiny tokenizer has one token per byte


def test_chat_completions_with_logprobs(oai):
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=5, logprobs=True
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert 1 <= len(choice.logprobs.content) <= 5
    assert out.usage.completion_tokens == len(choice.logprobs.content)


def test_chat_completions_streaming(oai):
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", {"prompt": [1], "logprobs": 5}, "logprobs may be 0 or 1"),
        ("/v1/completions", {"prompt": [1], "stop": ["\n"]}, "stop strings"),
        ("/v1/completions", {"prompt": [1], "best_of": 2}, "unknown field `best_of`"),
        ("/v1/completions", {"prompt": ""}, "input_ids is empty"),
        ("/v1/chat/completions", {"messages": []}, "messages is empty"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        # n is capped (max_n, 128 by default).
        ("/v1/completions", {"prompt": [1], "n": 129}, "n must be between 1 and 128"),
        ("/v1/chat/completions", {"messages": [USER], "n": 129}, "n must be between 1 and 128"),
        # max_tokens 0 is refused as vLLM does (it once meant "no limit" in chat).
        ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ("/v1/chat/completions", {"messages": [USER], "max_tokens": 0}, "max_tokens must be at least 1"),
        (
            "/v1/chat/completions",
            {"messages": [USER], "max_completion_tokens": 0, "max_tokens": 5},
            "max_completion_tokens must be at least 1",
        ),
        # Messages: a known role and content, named by index and field.
        (
            "/v1/chat/completions",
            {"messages": [USER, {"role": "wizard", "content": "x"}]},
            "messages[1].role",
        ),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content is missing"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [USER, {"role": "assistant"}]},
            "messages[1].content is missing",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0] must be a text part",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 7}]},
            "messages[0].content must be",
        ),
        # A chat template sent with the request is Jinja the server would run: refused unless trusted.
        (
            "/v1/chat/completions",
            {"messages": [USER], "chat_template": "{{ 1 }}"},
            "--trust-request-chat-template",
        ),
        (
            "/v1/chat/completions",
            {"messages": [USER], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            "--trust-request-chat-template",
        ),
    ],
)
def test_openai_bad_input_gets_400(embedded_server, path, body, fragment):
    body = {"max_tokens": 1, **body}  # keeps a request that a server wrongly accepts short
    response = httpx.post(f"{embedded_server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_openai_client_surfaces_400_as_bad_request(oai):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=-0.5)


def test_chat_accepts_tool_call_turns_and_text_parts(oai):
    """An assistant turn with tool_calls and no content is valid (as in OpenAI's API), so is content as text parts."""
    call = {"id": "c1", "type": "function", "function": {"name": "python", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "run it"}]},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_without_max_tokens_runs_to_the_context_length(oai):
    out = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    extra = out.choices[0].model_extra
    assert out.choices[0].finish_reason == "length"
    assert len(extra["prompt_token_ids"]) + len(extra["token_ids"]) == 1024  # TEST_ENGINE.max_model_len
