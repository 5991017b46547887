"""Request hygiene of the embedded server that needs its own engine in this process: text is tokenised off
the event loop, and a request's chat template is rendered only by a server that trusts it; plus the
`slipstream serve` flags of those settings.

The app is driven through httpx's ASGI transport on the test's event loop, so a hook in the tokenizer can
tell whether the loop was free to serve another request while tokenising.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest

from slipstream.rollouter.embedded.app import build_app
from slipstream.rollouter.embedded.engine import EmbeddedEngine
from slipstream.rollouter.serve import build_parser, config_to_args, parse_config
from tests.rollouter.conftest import TEST_ENGINE, run

# Bounds a wait that only a broken server would exhaust.
FAIL_AFTER_S = 30.0


@asynccontextmanager
async def serving(model_path, cfg=TEST_ENGINE) -> AsyncIterator[tuple[EmbeddedEngine, httpx.AsyncClient]]:
    engine = EmbeddedEngine(model_path, cfg)
    await engine.start()
    transport = httpx.ASGITransport(app=build_app(engine))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://embedded", timeout=60) as http:
            yield engine, http
    finally:
        engine.stop()


TEXT_REQUESTS = {
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}


@pytest.mark.parametrize("path", list(TEXT_REQUESTS))
def test_tokenising_leaves_the_event_loop_free(tiny_model_path, path):
    """While one request's text is being tokenised, the server answers another request."""
    entered, release = threading.Event(), threading.Event()
    released_by_test: list[bool] = []

    async def main():
        async with serving(tiny_model_path) as (engine, http):
            encode = engine.tokenizer.encode

            def held_encode(text, **kwargs):
                entered.set()
                released_by_test.append(release.wait(FAIL_AFTER_S))
                return encode(text, **kwargs)

            engine.tokenizer.encode = held_encode
            request = asyncio.create_task(http.post(path, json=TEXT_REQUESTS[path]))
            assert await asyncio.to_thread(entered.wait, FAIL_AFTER_S)
            health = await http.get("/health")  # served while the tokenizer is still busy
            release.set()
            return health.status_code, (await request).status_code

    assert run(main()) == (200, 200)
    assert released_by_test == [True], "the tokenizer ran on the event loop: /health waited for it"


def test_trusted_server_renders_a_request_chat_template(tiny_model_path):
    template = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    cfg = msgspec.structs.replace(TEST_ENGINE, trust_request_chat_template=True)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "return_token_ids": True,
    }

    async def main():
        async with serving(tiny_model_path, cfg) as (engine, http):
            top = await http.post("/v1/chat/completions", json={**body, "chat_template": template})
            nested = await http.post(
                "/v1/chat/completions", json={**body, "chat_template_kwargs": {"chat_template": template}}
            )
            return engine.tokenizer.encode("[user:hi]", add_special_tokens=False), top, nested

    expected, top, nested = run(main())
    for response in (top, nested):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["prompt_token_ids"] == expected


def test_serve_flags_round_trip_the_request_limits():
    cfg = msgspec.structs.replace(
        TEST_ENGINE, trust_request_chat_template=True, max_n=4, max_request_bytes=2048, stall_timeout_s=5.0
    )
    assert parse_config(build_parser().parse_args(["--model", "m", *config_to_args(cfg)])) == cfg
    bare = build_parser().parse_args(["--model", "m", "--trust-request-chat-template"])
    assert parse_config(bare).trust_request_chat_template is True
    assert parse_config(build_parser().parse_args(["--model", "m"])).trust_request_chat_template is False


HUGE = "lorem ipsum dolor sit amet " * (4 * 1024 * 1024 // 27)  # about 4 MiB of ordinary words


@pytest.mark.parametrize(
    "path",
    ["/generate", "/v1/completions", "/v1/chat/completions"],
)
def test_a_huge_text_prompt_is_refused_without_tokenising_it_whole(tiny_model_path, path):
    """Work on a prompt is bounded by the server's limit, not by the text: characters first, then the head's
    tokens; a normal request is served as before."""
    body = {
        "/generate": {"text": HUGE, "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"prompt": HUGE, "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 2},
    }[path]
    cfg = msgspec.structs.replace(TEST_ENGINE, max_request_bytes=8 << 20)
    encoded: list[int] = []

    async def main():
        async with serving(tiny_model_path, cfg) as (engine, http):
            encode = engine.tokenizer.encode

            def counting_encode(text, **kwargs):
                encoded.append(len(text))
                return encode(text, **kwargs)

            engine.tokenizer.encode = counting_encode
            huge = await http.post(path, json=body)
            small = await http.post(path, json=TEXT_REQUESTS[path])
            return huge, small

    huge, small = run(main())
    assert huge.status_code == 400 and "more than 1023 tokens" in huge.json()["error"]["message"]
    assert small.status_code == 200
    limit = (TEST_ENGINE.max_model_len - 1) * 8
    assert max(encoded) <= limit < len(HUGE) // 100  # the head at most, never the whole text


def test_bounded_encoding_refuses_by_characters_first_and_keeps_what_fits(tiny_model_path):
    from transformers import AutoTokenizer

    from slipstream.rollouter.embedded.engine import RequestError
    from slipstream.rollouter.embedded.http import encode_bounded, longest_token_chars

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    calls: list[int] = []
    encode = tok.encode
    tok.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    longest = longest_token_chars(tok)
    with pytest.raises(RequestError, match="more than 10 tokens"):
        encode_bounded(tok, "x" * (10 * longest + 1), 10)
    assert calls == []  # refused on characters alone
    text = "one two three four five"
    assert encode_bounded(tok, text, 64) == encode(text, add_special_tokens=False)
    with pytest.raises(RequestError, match="tokens; this server accepts at most 3"):
        encode_bounded(tok, text, 3)


def test_hostile_bodies_are_400s_naming_the_fault(tiny_model_path, caplog):
    """10,000-deep JSON where a schema takes any JSON (msgspec recurses per level) and prompt ids outside the vocabulary are the caller's
    errors: 400, no traceback."""
    deep = b'{"messages": [{"role": "user", "content": ' + b"[" * 10_000 + b"]" * 10_000 + b"}]}"

    async def main():
        async with serving(tiny_model_path) as (engine, http):
            nested = await http.post("/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"})
            ids = [
                await http.post("/generate", json={"input_ids": [1, bad, 2]})
                for bad in (-1, engine.vocab_size)
            ]
            return nested, ids, engine.vocab_size

    nested, ids, vocab = run(main())
    assert nested.status_code == 400
    assert nested.json()["error"]["message"] == "the request body nests too deeply to decode"
    for response, bad in zip(ids, (-1, vocab), strict=True):
        assert response.status_code == 400
        assert f"token id {bad}, outside the vocabulary [0, {vocab})" in response.json()["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info]
