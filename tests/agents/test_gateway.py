"""The OpenAI gateway against a real embedded server process, driven by the official ``openai`` client.

The tiny random model is first taught one calculator conversation (a few seconds of Adam, loss on the
assistant tokens only, until greedy decoding reproduces it), so that a real server really emits a tool call:

    system+user:  What is 6 * 7?          (tools: calculator)
    assistant:    <tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>
    tool:         42
    assistant:    42

Every check compares the gateway's record with the raw outputs the server returned (a recording wrapper
sits between the gateway and the server client) and with what the harness received.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from openai import AsyncOpenAI, AuthenticationError, BadRequestError, NotFoundError

from slipstream.agents.gateway import Gateway
from slipstream.agents.gateway.render import GatewayRenderer
from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
from slipstream.rollouter.launch import launch_server
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
QUESTION = [{"role": "user", "content": "What is 6 * 7?"}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
ENGINE = EmbeddedServerConfig(
    num_threads=1, max_model_len=1024, kv_cache_tokens=8192, kv_page_size=64, max_batch_tokens=512, seed=0
)
GREEDY = SamplingParams(max_new_tokens=96, temperature=0.0)


def conversation_ids(tok) -> tuple[list[int], list[int]]:
    """Ids of the taught conversation as the gateway renders it, and its loss mask (assistant tokens)."""
    r = GatewayRenderer(tok)
    key = json.dumps([CALCULATOR], sort_keys=True)
    eot = r.renderer(key, [CALCULATOR]).end_of_turn_id
    prompt = r.full_ids(QUESTION, [CALCULATOR], key)
    turn1 = tok.encode(CALL, add_special_tokens=False) + [eot]
    tool = r.delta_ids([{"role": "tool", "tool_call_id": "x", "content": "42"}], [CALCULATOR], key, True)
    turn2 = tok.encode("42", add_special_tokens=False) + [eot]
    ids = prompt + turn1 + tool + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    return ids, mask


def teach(model_path, out_dir, ids: list[int], mask: list[int]):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    inputs, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    weight = torch.tensor(mask[1:], dtype=torch.bool)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(400):
        logits = model(inputs).logits[0][weight]
        target = logits.gather(1, targets[weight][:, None])[:, 0]
        other = logits.scatter(1, targets[weight][:, None], float("-inf")).max(-1).values
        if float((target - other).min().detach()) > 2.0:  # greedy decoding reproduces it with a margin
            break
        loss = torch.nn.functional.cross_entropy(logits, targets[weight])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the conversation was not learned")
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("calculator-model")
    teach(tiny_model_path, out, *conversation_ids(tok))
    proc = launch_server(
        server_kind("embedded"), out, cfg=RolloutConfig(embedded=ENGINE), log_path=out / "server.log"
    )
    try:
        proc.wait_healthy(timeout_s=180)
        yield proc
    finally:
        proc.stop()


class Recording:
    """Keeps every raw server output (and the ids sent), to compare with what the gateway recorded."""

    def __init__(self, client):
        self.client = client
        self.calls: list[tuple[list[int], object]] = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
        out = await self.client.generate(input_ids, sampling, rid=rid, session_id=session_id)
        self.calls.append((list(input_ids), out.__copy__()))
        return out

    async def abort(self, rid):
        await self.client.abort(rid)


async def _gateway(url, tok, sampling=GREEDY):
    raw = SGLangClient(url)
    rec = Recording(raw)
    gw = Gateway(PartialRolloutClient(rec, max_in_flight=4), tok, sampling=sampling, max_total_tokens=1024)
    await gw.start()
    return gw, rec, raw


def _openai(session) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def _assert_segment_matches(seg, calls):
    """The segment is the server's outputs exactly (mask 1) between the gateway's inserted tokens (mask 0),
    and each request sent exactly the segment's tokens before it."""
    pos = 0
    for input_ids, out in calls:
        assert input_ids == seg.prompt_ids + seg.response_ids[: len(input_ids) - len(seg.prompt_ids)]
        start = len(input_ids) - len(seg.prompt_ids)
        assert seg.loss_mask[pos:start] == [0] * (start - pos)
        end = start + len(out.output_ids)
        assert seg.response_ids[start:end] == out.output_ids
        assert seg.logprobs[start:end] == out.logprobs  # the floats the server sent, bit for bit
        assert seg.versions[start:end] == out.versions
        assert seg.loss_mask[start:end] == [1] * len(out.output_ids)
        pos = end
    assert pos == len(seg.response_ids)


def test_tool_calls_chat_and_streaming_are_recorded_exactly(server, tok):
    async def main():
        gw, rec, raw = await _gateway(server.url, tok)
        try:
            session = gw.open_session("ep-tools")
            client = _openai(session)
            messages = list(QUESTION)
            first = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR], extra_body={"return_token_ids": True}
            )
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0]
            assert call.function.name == "calculator"
            assert json.loads(call.function.arguments) == {"expression": "6 * 7"}
            assert choice.model_extra["token_ids"] == rec.calls[0][1].output_ids
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "42"},
            ]
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CALCULATOR],
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
            )
            text, finish, usage, logprobs = "", None, None, []
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
                    logprobs += [e.logprob for e in (c.logprobs.content if c.logprobs else [])]
            assert (text, finish) == ("42", "stop")
            assert logprobs == rec.calls[1][1].logprobs
            assert usage.completion_tokens == len(rec.calls[1][1].output_ids)
            episode = await gw.close_session(session)
        finally:
            await gw.stop()
            await raw.aclose()
        return episode, rec

    episode, rec = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(episode.segments) == 1 and episode.divergences == 0 and episode.requests == 2
    seg = episode.segments[0]
    _assert_segment_matches(seg, rec.calls)
    assert seg.num_turns == 2 and episode.final_text == "42"
    ids, mask = conversation_ids(tok)  # the taught conversation, token for token
    assert seg.prompt_ids + seg.response_ids == ids
    assert [0] * len(seg.prompt_ids) + seg.loss_mask == mask


def test_divergent_history_starts_a_new_segment(server, tok):
    async def main():
        gw, rec, raw = await _gateway(server.url, tok, SamplingParams(max_new_tokens=12, temperature=1.0))
        try:
            session = gw.open_session("ep-diverge")
            client = _openai(session)
            history = [{"role": "user", "content": "Say something."}]
            reply = await client.chat.completions.create(model="policy", messages=history)
            history += [{"role": "assistant", "content": reply.choices[0].message.content}]
            history += [{"role": "user", "content": "More."}]
            await client.chat.completions.create(model="policy", messages=history)  # extends
            assert len(session.segments) == 1
            edited = [{"role": "user", "content": "Say something else."}, *history[1:]]
            await client.chat.completions.create(model="policy", messages=edited)  # an edited message
            truncated = history[:1]
            await client.chat.completions.create(model="policy", messages=truncated)  # history dropped
            return await gw.close_session(session), rec
        finally:
            await gw.stop()
            await raw.aclose()

    episode, rec = asyncio.run(asyncio.wait_for(main(), 120))
    assert episode.divergences == 2 and len(episode.segments) == 3 and episode.requests == 4
    _assert_segment_matches(episode.segments[0], rec.calls[:2])
    for seg, call in zip(episode.segments[1:], rec.calls[2:], strict=True):
        assert seg.prompt_ids == call[0]  # a fresh rendering: nothing from the old segment carried over
        _assert_segment_matches(seg, [call])
    r = GatewayRenderer(tok)
    assert episode.segments[2].prompt_ids == r.full_ids(
        [{"role": "user", "content": "Say something."}], None, ""
    )


def test_abort_at_a_weight_push_is_resumed_invisibly(server, tok):
    """A pause in abort mode (what a weight push does) ends the server's request with partial tokens; the
    harness still gets one normal reply, and the record is the concatenation of the pieces."""

    async def main():
        gw, rec, raw = await _gateway(server.url, tok, SamplingParams(max_new_tokens=200, temperature=1.0))
        http = httpx.AsyncClient(base_url=server.url, timeout=30)
        try:
            for attempt in range(5):
                session = gw.open_session(f"ep-abort-{attempt}")
                rec.calls.clear()
                before = (await http.get("/model_info")).json()["generated_tokens"]
                request = asyncio.create_task(
                    _openai(session).chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "Count to ten."}]
                    )
                )
                while (
                    not request.done()
                    and (await http.get("/model_info")).json()["generated_tokens"] < before + 4
                ):
                    await asyncio.sleep(0.005)
                await raw.pause("abort")
                await raw.resume()
                reply = await request
                episode = await gw.close_session(session)
                if episode.resumes:
                    return reply, episode, list(rec.calls)
            raise AssertionError("the request finished before the pause in every attempt")
        finally:
            await http.aclose()
            await gw.stop()
            await raw.aclose()

    reply, episode, calls = asyncio.run(asyncio.wait_for(main(), 180))
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert len(calls) == 2 and calls[0][1].finish_reason == "abort"
    seg = episode.segments[0]
    assert seg.loss_mask == [1] * len(seg.response_ids)
    assert seg.response_ids == calls[0][1].output_ids + calls[1][1].output_ids
    assert seg.logprobs == calls[0][1].logprobs + calls[1][1].logprobs
    assert calls[1][0] == seg.prompt_ids + calls[0][1].output_ids  # resumed from prompt + partial
    assert reply.choices[0].message.content == tok.decode(seg.response_ids, skip_special_tokens=True)


def test_sessions_are_isolated_and_bad_requests_cost_only_themselves(server, tok):
    async def main():
        gw, rec, raw = await _gateway(server.url, tok, SamplingParams(max_new_tokens=4, temperature=1.0))
        try:
            a, b = gw.open_session("ep-a"), gw.open_session("ep-b")
            assert a.api_key != b.api_key and a.base_url != b.base_url and "127.0.0.1" in a.base_url
            stolen = AsyncOpenAI(base_url=b.base_url, api_key=a.api_key, max_retries=0)
            with pytest.raises(AuthenticationError):
                await stolen.chat.completions.create(model="p", messages=QUESTION)
            bare = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=a.api_key, max_retries=0)
            await bare.chat.completions.create(model="p", messages=QUESTION)  # the key alone finds A
            with pytest.raises(BadRequestError, match="n must be an integer from 1"):
                await _openai(a).chat.completions.create(model="p", messages=QUESTION, n=0)
            with pytest.raises(BadRequestError, match="role"):
                await _openai(a).chat.completions.create(model="p", messages=[{"content": "x"}])
            async with httpx.AsyncClient() as http:
                bad = await http.post(f"{a.base_url}/chat/completions", content=b"{not json",
                                      headers={"Authorization": f"Bearer {a.api_key}"})  # fmt: skip
                assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
            text = await _openai(a).completions.create(model="p", prompt="Hello", max_tokens=3)
            assert text.choices[0].text is not None
            closed = await gw.close_session(a)
            with pytest.raises(NotFoundError):
                await _openai(a).chat.completions.create(model="p", messages=QUESTION)
            return closed, await gw.close_session(b)
        finally:
            await gw.stop()
            await raw.aclose()

    a, b = asyncio.run(asyncio.wait_for(main(), 120))
    assert b.requests == 0 and b.segments == [] and b.errors == 0
    assert a.errors == 3 and len(a.segments) == 2  # a chat segment, then a completion segment
    assert a.segments[1].loss_mask == [1] * len(a.segments[1].response_ids)


class FailsOnce(Recording):
    """The first generate fails as an unreachable server would."""

    failed = False

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
        if not self.failed:
            self.failed = True
            raise ConnectionError("server went away")
        return await super().generate(input_ids, sampling, rid=rid, session_id=session_id)


def test_a_failed_generation_records_nothing_and_a_retry_continues_the_segment(server, tok):
    from openai import InternalServerError

    async def main():
        raw = SGLangClient(server.url)
        rec = Recording(raw)
        flaky = FailsOnce(rec)
        flaky.failed = True  # the first turn goes through
        gw = Gateway(
            flaky, tok, sampling=SamplingParams(max_new_tokens=6, temperature=1.0), max_total_tokens=1024
        )
        await gw.start()
        try:
            session = gw.open_session("ep-retry")
            client = _openai(session)
            history = [{"role": "user", "content": "Hello."}]
            first = await client.chat.completions.create(model="p", messages=history)
            history += [{"role": "assistant", "content": first.choices[0].message.content}]
            history += [{"role": "user", "content": "Again."}]
            flaky.failed = False
            with pytest.raises(InternalServerError, match="server went away"):
                await client.chat.completions.create(model="p", messages=history)
            await client.chat.completions.create(model="p", messages=history)  # the harness retries
            return await gw.close_session(session), rec
        finally:
            await gw.stop()
            await raw.aclose()

    episode, rec = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(episode.segments) == 1 and episode.divergences == 0 and episode.errors == 1
    _assert_segment_matches(episode.segments[0], rec.calls)


def test_tool_choice_none_required_and_named(server, tok):
    """none: the call comes back as text; required and a named function: the reply is forced to open the call
    (inserted tokens, loss_mask 0) and the model generates the rest."""

    async def main():
        gw, rec, raw = await _gateway(server.url, tok)
        try:
            got = {}
            named = {"type": "function", "function": {"name": "calculator"}}
            for choice in ("none", "required", named):
                session = gw.open_session(f"ep-choice-{len(got)}")
                reply = await _openai(session).chat.completions.create(
                    model="p", messages=QUESTION, tools=[CALCULATOR], tool_choice=choice,
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
                got[json.dumps(choice)] = (reply.choices[0], await gw.close_session(session), rec.calls[-1])
            with pytest.raises(BadRequestError, match="not among the tools"):
                bad = gw.open_session("ep-bad-choice")
                await _openai(bad).chat.completions.create(
                    model="p", messages=QUESTION, tools=[CALCULATOR],
                    tool_choice={"type": "function", "function": {"name": "search"}},
                )  # fmt: skip
            return got
        finally:
            await gw.stop()
            await raw.aclose()

    got = asyncio.run(asyncio.wait_for(main(), 120))
    none, _, _ = got['"none"']
    assert none.finish_reason == "stop" and not none.message.tool_calls
    assert '"name": "calculator"' in none.message.content  # the call, as text
    for key in ('"required"', json.dumps({"type": "function", "function": {"name": "calculator"}})):
        choice, episode, (sent, out) = got[key]
        assert choice.finish_reason == "tool_calls", (key, choice)
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "6 * 7"}
        seg = episode.segments[0]
        forced = len(sent) - len(seg.prompt_ids)  # the server got the prompt plus the forced opening
        assert forced > 0 and seg.loss_mask[:forced] == [0] * forced
        assert seg.response_ids[:forced] == sent[len(seg.prompt_ids) :]
        assert seg.response_ids[forced:] == out.output_ids and seg.loss_mask[forced:] == [1] * len(
            out.output_ids
        )
        assert tok.decode(seg.response_ids, skip_special_tokens=False).startswith(CALL)


def test_stop_strings_end_the_reply_and_the_record(server, tok):
    async def main():
        gw, rec, raw = await _gateway(server.url, tok)
        try:
            session = gw.open_session("ep-stop")
            client = _openai(session)
            first = await client.chat.completions.create(
                model="p", messages=QUESTION, tools=[CALCULATOR], stop=['"arguments"', "never"]
            )
            history = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "user", "content": "Go on."}]  # fmt: skip
            await client.chat.completions.create(
                model="p", messages=history, tools=[CALCULATOR], max_tokens=3
            )
            return first.choices[0], await gw.close_session(session), rec.calls
        finally:
            await gw.stop()
            await raw.aclose()

    choice, episode, calls = asyncio.run(asyncio.wait_for(main(), 120))
    assert choice.finish_reason == "stop" and choice.message.content.endswith('{"name": "calculator", ')
    assert not choice.message.tool_calls
    (sent0, out0), (sent1, _) = calls
    seg = episode.segments[0]
    assert len(episode.segments) == 1 and episode.divergences == 0  # the harness's echo extends the segment
    kept = tok.decode(seg.response_ids[: seg.loss_mask.index(0)], skip_special_tokens=True)
    assert (
        kept.endswith('"arguments"')
        and kept == tok.decode(out0.output_ids, skip_special_tokens=True)[: len(kept)]
    )
    k = seg.loss_mask.index(0)
    assert sent1[: len(seg.prompt_ids) + k] == seg.prompt_ids + seg.response_ids[:k]
    assert len(out0.output_ids) > k  # the server sampled on; the record stops at the stop


def test_n_samples_concurrently_and_only_the_reply_sent_back_is_recorded(server, tok):
    async def main():
        gw, rec, raw = await _gateway(server.url, tok, SamplingParams(max_new_tokens=8, temperature=1.0))
        try:
            session = gw.open_session("ep-n")
            client = _openai(session)
            history = [{"role": "user", "content": "Say something."}]
            many = await client.chat.completions.create(
                model="p", messages=history, n=3, extra_body={"return_token_ids": True}
            )
            assert [c.index for c in many.choices] == [0, 1, 2]
            kept = many.choices[1]
            history += [
                {"role": "assistant", "content": kept.message.content},
                {"role": "user", "content": "More."},
            ]
            await client.chat.completions.create(model="p", messages=history)
            return many, await gw.close_session(session), rec.calls
        finally:
            await gw.stop()
            await raw.aclose()

    many, episode, calls = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(calls) == 4 and len({tuple(c[0]) for c in calls[:3]}) == 1  # one prompt, three samples
    (seg,) = episode.segments
    assert episode.divergences == 0 and seg.num_turns == 2
    ids = [c.model_extra["token_ids"] for c in many.choices]
    assert seg.response_ids[: len(ids[1])] == ids[1]  # the kept reply continues the segment
    out = calls[3][1]  # the next reply ends the segment; between them only the new message (mask 0)
    assert seg.response_ids[-len(out.output_ids) :] == out.output_ids
    assert sum(seg.loss_mask) == len(ids[1]) + len(out.output_ids)  # the other replies are not trained


def test_streaming_sends_tokens_as_they_are_made_and_hides_an_abort(server, tok):
    """A streamed reply arrives in many chunks while the server generates; a weight push's abort in the
    middle (pause in abort mode) is resumed below the gateway, and the harness's text is the recorded
    segment's, pieces and all."""

    async def main():
        gw, rec, raw = await _gateway(server.url, tok, SamplingParams(max_new_tokens=200, temperature=1.0))
        try:
            for attempt in range(5):
                session = gw.open_session(f"ep-stream-{attempt}")
                rec.calls.clear()
                stream = await _openai(session).chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "Count to ten."}], stream=True
                )
                parts, finish, pushed = [], None, False
                async for chunk in stream:
                    for c in chunk.choices:
                        finish = c.finish_reason or finish
                        if c.delta.content:
                            parts.append(c.delta.content)
                            if not pushed:  # the first tokens are out: a weight push aborts the request
                                pushed = True
                                await raw.pause("abort")
                                await raw.resume()
                episode = await gw.close_session(session)
                if episode.resumes:
                    return parts, finish, episode, list(rec.calls)
            raise AssertionError("the request finished before the push in every attempt")
        finally:
            await gw.stop()
            await raw.aclose()

    parts, finish, episode, calls = asyncio.run(asyncio.wait_for(main(), 180))
    assert finish in ("stop", "length") and len(parts) >= 3  # streamed, not one chunk at the end
    assert len(calls) == 2 and calls[0][1].finish_reason == "abort"
    seg = episode.segments[0]
    assert seg.response_ids == calls[0][1].output_ids + calls[1][1].output_ids
    assert "".join(parts) == tok.decode(seg.response_ids, skip_special_tokens=True)
