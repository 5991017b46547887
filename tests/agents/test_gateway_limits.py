"""The gateway against hostile clients, over real HTTP on loopback: huge chats are refused before they are
rendered, rendering runs off the event loop, deep JSON and out-of-vocabulary ids are 400s, and of an
``n`` > 1 request's replies only the one the harness used is recorded.

The inference server is scripted (agent_fakes.py): these checks are about what reaches it, not what it does.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest

from slipstream.agents.gateway import Gateway
from slipstream.agents.gateway.checks import MAX_JSON_DEPTH
from slipstream.agents.protocol import SamplingParams
from slipstream.utils.text_bounds import longest_token_chars
from tests.agents.agent_fakes import ScriptedClient

MAX_TOTAL = 256


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def run(main):
    return asyncio.run(asyncio.wait_for(main(), 120))  # a guard against a hang, not a timed assertion


async def _gateway(tok, replies):
    client = ScriptedClient(tok, replies)
    gw = Gateway(client, tok, sampling=SamplingParams(max_new_tokens=16), max_total_tokens=MAX_TOTAL)
    await gw.start()
    return gw, client


def _http(session) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {session.api_key}"}
    return httpx.AsyncClient(base_url=session.base_url, headers=headers, timeout=60)


def _chat(text: str, **extra) -> dict:
    return {"model": "p", "messages": [{"role": "user", "content": text}], **extra}


def _message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


@pytest.mark.parametrize("char", ["x", "語"])
def test_a_chat_longer_than_the_budget_is_refused_before_rendering(tok, char):
    limit = MAX_TOTAL * longest_token_chars(tok)

    async def main():
        gw, client = await _gateway(tok, ["ok"])
        rendered: list[int] = []
        full_ids = gw.renderer.full_ids
        gw.renderer.full_ids = lambda m, *a: rendered.append(len(m)) or full_ids(m, *a)
        try:
            session = gw.open_session("ep-huge")
            async with _http(session) as http:
                huge = await http.post("/chat/completions", json=_chat(char * (limit + 1)))
                small = await http.post("/chat/completions", json=_chat("hi"))
            return huge, small, rendered, client.requests
        finally:
            await gw.stop()

    huge, small, rendered, requests = run(main)
    assert huge.status_code == 400
    assert huge.json()["error"]["type"] == "context_length_exceeded"
    assert f"at most {limit} characters" in _message(huge) and "agent.max_total_tokens" in _message(huge)
    assert small.status_code == 200
    assert rendered == [1] and len(requests) == 1  # only the small chat was rendered and generated


def test_rendering_runs_off_the_event_loop(tok):
    """A render held in its worker thread does not stop another session's request from being answered."""

    async def main():
        gw, _ = await _gateway(tok, ["first", "second"])
        started, release = threading.Event(), threading.Event()
        released_in_time: list[bool] = []
        full_ids = gw.renderer.full_ids

        def held(messages, *args):
            if messages[0]["content"] == "hold":
                started.set()
                released_in_time.append(release.wait(60))  # False only if the loop never answered B
            return full_ids(messages, *args)

        gw.renderer.full_ids = held
        try:
            a, b = gw.open_session("ep-a"), gw.open_session("ep-b")
            async with _http(a) as http_a, _http(b) as http_b:
                first = asyncio.create_task(http_a.post("/chat/completions", json=_chat("hold")))
                await asyncio.to_thread(started.wait, 60)
                second = await http_b.post("/chat/completions", json=_chat("go"))
                answered_while_held = not release.is_set()
                release.set()
                return await first, second, answered_while_held, released_in_time
        finally:
            release.set()
            await gw.stop()

    first, second, answered_while_held, released_in_time = run(main)
    assert second.status_code == 200 and answered_while_held
    assert first.status_code == 200 and released_in_time == [True]


def test_deep_json_is_a_400_without_a_traceback(tok, caplog):
    deep = b'{"model": "p", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    shallow_enough_to_parse = b'{"x": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"

    async def main():
        gw, client = await _gateway(tok, [])
        try:
            session = gw.open_session("ep-deep")
            async with _http(session) as http:
                headers = {"Content-Type": "application/json"}
                out = [await http.post("/chat/completions", content=body, headers=headers)
                       for body in (deep, shallow_enough_to_parse)]  # fmt: skip
            return out, client.requests
        finally:
            await gw.stop()

    with caplog.at_level(logging.WARNING):
        responses, requests = run(main)
    for response in responses:
        assert response.status_code == 400
        assert _message(response) == f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    assert requests == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_prompt_ids_outside_the_vocabulary_are_a_400_naming_the_id(tok, bad):
    bad_id = len(tok) if bad == "vocab" else bad

    async def main():
        gw, client = await _gateway(tok, [])
        try:
            session = gw.open_session("ep-ids")
            async with _http(session) as http:
                body = {"model": "p", "prompt": [1, 2, bad_id, 3]}
                return await http.post("/completions", json=body), client.requests
        finally:
            await gw.stop()

    response, requests = run(main)
    assert response.status_code == 400
    assert _message(response) == f"prompt contains token id {bad_id}, outside the vocabulary [0, {len(tok)})"
    assert requests == []


def test_a_prompt_over_the_budget_is_a_400_and_one_that_fills_it_an_empty_reply(tok):
    """A prompt of more tokens than an episode may hold is OpenAI's context_length_exceeded, before any server
    sees it; one that fills the budget exactly leaves no token to generate: an empty reply cut by length."""

    async def main():
        gw, client = await _gateway(tok, [])
        try:
            session = gw.open_session("ep-long")
            async with _http(session) as http:
                over = await http.post("/completions", json={"model": "p", "prompt": [5] * (MAX_TOTAL + 1)})
                full = await http.post("/completions", json={"model": "p", "prompt": [5] * MAX_TOTAL})
            return over, full, client.requests
        finally:
            await gw.stop()

    over, full, requests = run(main)
    assert over.status_code == 400 and over.json()["error"]["type"] == "context_length_exceeded"
    assert (
        _message(over) == f"the prompt holds {MAX_TOTAL + 1} tokens, more than an episode's {MAX_TOTAL} "
        "(agent.max_total_tokens)"
    )
    assert full.status_code == 200
    (choice,) = full.json()["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert requests == []


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("continues", ["second", "none", "episode ends"])
def test_of_n_chat_replies_only_the_one_the_harness_used_is_recorded(tok, continues):
    async def main():
        gw, _ = await _gateway(tok, ["alpha", "bravo", "charlie", "next"])
        try:
            session = gw.open_session("ep-n")
            history = [{"role": "user", "content": "Say something."}]
            async with _http(session) as http:
                many = await http.post("/chat/completions", json={"model": "p", "messages": history, "n": 3})
                used = {"second": "bravo", "none": "an edited reply"}.get(continues)
                if used is not None:
                    history += [{"role": "assistant", "content": used}, {"role": "user", "content": "More."}]
                    await http.post("/chat/completions", json={"model": "p", "messages": history})
            return many.json(), await gw.close_session(session)
        finally:
            await gw.stop()

    many, episode = run(main)
    assert [c["message"]["content"] for c in many["choices"]] == ["alpha", "bravo", "charlie"]
    recorded = [seg.response_ids for seg in episode.segments]
    if continues == "second":  # one segment: bravo, the new message (mask 0), then the next reply
        (ids,) = recorded
        assert ids[: len(_ids(tok, "bravo"))] == _ids(tok, "bravo") and ids[
            -len(_ids(tok, "next")) :
        ] == _ids(tok, "next")
        assert sum(episode.segments[0].loss_mask) == len(_ids(tok, "bravo")) + len(_ids(tok, "next"))
    elif continues == "none":  # the old segment keeps no reply; the new one only its own
        assert recorded == [[], _ids(tok, "next")] and episode.divergences == 1
    else:  # which one was used cannot be seen: the first, the one final_text holds
        assert recorded == [_ids(tok, "alpha")] and episode.final_text == "alpha"


def test_of_n_completions_only_the_one_continued_is_recorded(tok):
    async def main():
        gw, _ = await _gateway(tok, ["A1", "B2", "next"])
        try:
            session = gw.open_session("ep-nc")
            async with _http(session) as http:
                await http.post("/completions", json={"model": "p", "prompt": "Q:", "n": 2})
                await http.post("/completions", json={"model": "p", "prompt": "Q:B2\nQ:"})
            return await gw.close_session(session)
        finally:
            await gw.stop()

    episode = run(main)
    (seg,) = episode.segments
    b2, nl, nxt = _ids(tok, "B2"), tok.encode("\nQ:", add_special_tokens=False), _ids(tok, "next")
    assert seg.response_ids == b2 + nl + nxt
    assert seg.loss_mask == [1] * len(b2) + [0] * len(nl) + [1] * len(nxt)
