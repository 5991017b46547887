"""The embedded server as a real process on loopback, driven over HTTP (SGLang-native routes)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import httpx
import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.serverkinds.sglang import SGLangClient
from tests.rollouter.conftest import run


@pytest.fixture(scope="module")
def tf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


async def _running(http: httpx.AsyncClient, at_least: int = 1) -> None:
    for _ in range(600):
        if (await http.get("/model_info")).json()["num_running_requests"] >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the requests never started running")


async def _stream_until(http, body: dict, min_tokens: int, on_progress):
    """POST a streaming /generate; call ``on_progress(chunk)`` once ``min_tokens`` tokens were seen."""
    chunks, fired = [], False
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append("[DONE]")
                break
            chunk = json.loads(line[len("data: ") :])
            chunks.append(chunk)
            if not fired and len(chunk["output_ids"]) >= min_tokens:
                fired = True
                await on_progress(chunk)
    return chunks


def test_generate_returns_sglang_shapes_and_faithful_logprobs(embedded_server, tf_model):
    prompt = [5, 17, 99, 3]

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "ignore_eos": True},
                "return_logprob": True,
                "rid": "shape-1",
            }
            return (await http.post("/generate", json=body)).json()

    out = run(main())
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 24
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 24}]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
    expected = teacher_forced_logprobs(tf_model, prompt, out["output_ids"], temperature=0.7)
    assert torch.allclose(torch.tensor([t[0] for t in triples]), expected, atol=1e-4)


def test_client_generate_greedy_matches_argmax(embedded_server, tf_model):
    prompt = [40, 41, 42]

    async def main():
        client = SGLangClient(embedded_server.url)
        try:
            return await client.generate(
                prompt, SamplingParams(max_new_tokens=8, temperature=0.0), rid="greedy"
            )
        finally:
            await client.aclose()

    out = run(main())
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) > 0
    assert out.versions == [0] * len(out.output_ids) and out.server == embedded_server.url
    assert out.logprobs == [0.0] * len(out.output_ids)  # greedy: the sampling distribution is one-hot
    with torch.no_grad():
        logits = tf_model(torch.tensor([prompt + out.output_ids])).logits[0]
    assert out.output_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()[: len(out.output_ids)]


def test_streaming_sends_cumulative_chunks(embedded_server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            return await _stream_until(http, {**body, "return_logprob": True}, 10**9, None)

    chunks = run(main())
    assert chunks[-1] == "[DONE]" and len(chunks) >= 2
    data = chunks[:-1]
    for prev, cur in zip(data, data[1:], strict=False):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(data[-1]["output_ids"]) == 12 == len(data[-1]["meta_info"]["output_token_logprobs"])


def test_abort_returns_partial_tokens(embedded_server):
    rid = f"abort-{uuid.uuid4().hex[:6]}"
    body = {
        "input_ids": [7, 8, 9],
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
    }

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:

            async def abort(_chunk):
                await http.post("/abort_request", json={"rid": rid})

            return await _stream_until(http, {**body, "return_logprob": True}, 5, abort)

    chunks = run(main())
    final = chunks[-2]
    n = len(final["output_ids"])
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= n < 1000
    assert len(final["meta_info"]["output_token_logprobs"]) == n
    assert final["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]


def test_client_abort_ends_pending_generate(embedded_server):
    async def main():
        client = SGLangClient(embedded_server.url)
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            task = asyncio.create_task(
                client.generate([3, 4], SamplingParams(max_new_tokens=1000), rid="c-abort")
            )
            await _running(http)
            await client.abort("c-abort")
            out = await task
        await client.aclose()
        return out

    out = run(main())
    # The random model may emit its EOS before the abort lands; either way the output is consistent.
    assert out.finish_reason in ("abort", "stop")
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) < 1000


def test_pause_abort_mode_ends_running_and_holds_new_requests(embedded_server):
    long = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            running = [
                asyncio.create_task(http.post("/generate", json={**long, "rid": f"pa-{i}"})) for i in range(2)
            ]
            await _running(http, 2)
            r = await http.post("/pause_generation", json={"mode": "abort"})
            assert r.json()["status"] == "ok"
            aborted = [(await t).json() for t in running]
            held = asyncio.create_task(
                http.post("/generate", json={"input_ids": [4], "sampling_params": {"max_new_tokens": 3}})
            )
            await asyncio.sleep(0.5)
            held_while_paused = not held.done()
            await http.post("/continue_generation", json={})
            return aborted, held_while_paused, (await held).json()

    aborted, held_while_paused, late = run(main())
    for out in aborted:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) < 1000
    assert held_while_paused
    assert late["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_pause_in_place_freezes_and_continues(embedded_server):
    body = {
        "input_ids": [9, 9],
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
        "rid": "inplace",
    }
    seen: dict = {}

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:

            async def pause_then_continue(chunk):
                await http.post("/pause_generation", json={"mode": "in_place"})
                info = (await http.get("/model_info")).json()
                seen["paused"] = info["paused"]
                seen["running"] = info["num_running_requests"]
                await asyncio.sleep(0.5)
                seen["frozen"] = (await http.get("/model_info")).json()["generated_tokens"] == info[
                    "generated_tokens"
                ]
                await http.post("/continue_generation", json={})

            return await _stream_until(http, body, 3, pause_then_continue)

    chunks = run(main())
    assert seen == {"paused": "in_place", "running": 1, "frozen": True}
    final = chunks[-2]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert len(final["output_ids"]) == 200


def test_concurrent_requests_all_complete(embedded_server, tiny_model_path):
    eos_id = json.loads((tiny_model_path / "config.json").read_text())["eos_token_id"]

    async def main():
        client = SGLangClient(embedded_server.url)
        try:
            calls = [
                client.generate([i + 1, i + 2], SamplingParams(max_new_tokens=10 + i), rid=f"conc-{i}")
                for i in range(16)
            ]
            return await asyncio.gather(*calls)
        finally:
            await client.aclose()

    outs = run(main())
    assert [o.rid for o in outs] == [f"conc-{i}" for i in range(16)]
    for i, out in enumerate(outs):
        assert 1 <= len(out.output_ids) <= 10 + i
        # An EOS sampled as the very last allowed token is a stop, as in SGLang.
        ended_on_eos = out.output_ids[-1] == eos_id
        assert out.finish_reason == ("stop" if ended_on_eos else "length")
        assert ended_on_eos or len(out.output_ids) == 10 + i
        assert len(out.logprobs) == len(out.versions) == len(out.output_ids)


BAD_BODIES = [
    (b'{"input_ids": [1, 2', "malformed JSON"),
    (b'{"input_ids": [1], "bogus": 1}', "unknown field `bogus`"),
    (b'{"input_ids": [1], "sampling_params": {"min_p": 0.1}}', "unknown field `min_p`"),
    (b'{"input_ids": []}', "input_ids is empty"),
    (b'{"input_ids": [[1, 2], [3]]}', "input_ids"),
    (json.dumps({"input_ids": list(range(1, 200)) * 6}).encode(), "accepts at most"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', "top_k"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}', "max_new_tokens"),
    (b'{"input_ids": [99999]}', "outside the vocabulary"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', "Expected `float`"),
    (b'{"text": "hi", "input_ids": [1]}', "exactly one of"),
    (b"[1, 2, 3]", "Expected `object`"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD_BODIES, ids=[b[1][:24] for b in BAD_BODIES])
def test_bad_input_gets_400_and_server_keeps_serving(embedded_server, body, fragment):
    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            bad = await http.post("/generate", content=body, headers={"content-type": "application/json"})
            good = await http.post(
                "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
            )
            return bad, good

    bad, good = run(main())
    assert bad.status_code == 400
    assert fragment in bad.json()["error"]["message"]
    assert good.status_code == 200 and embedded_server.is_alive()


def test_control_routes_reject_bad_input(embedded_server):
    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            bad_mode = await http.post("/pause_generation", json={"mode": "sideways"})
            bad_field = await http.post("/abort_request", json={"rid": "x", "everything": True})
            info = (await http.get("/model_info")).json()
            health = await http.get("/health")
            return bad_mode, bad_field, info, health

    bad_mode, bad_field, info, health = run(main())
    assert bad_mode.status_code == 400 and "pause mode" in bad_mode.json()["error"]["message"]
    assert bad_field.status_code == 400
    assert info["weight_version"] == "0" and info["paused"] is None and info["vocab_size"] > 256
    assert health.status_code == 200


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-38},
        {"temperature": 1e30},
        {"top_p": 1e-30},
        {"top_k": 10**9},
        {"max_new_tokens": 10**12},
    ],
    ids=["tiny-temperature", "huge-temperature", "tiny-top-p", "huge-top-k", "huge-max-new-tokens"],
)
def test_extreme_sampling_values_are_served(embedded_server, sampling):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, **sampling}, "return_logprob": True}

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            out = await http.post("/generate", json=body)
            return out, await http.get("/health")

    out, health = run(main())
    assert out.status_code == 200 and health.status_code == 200
    logprobs = [t[0] for t in out.json()["meta_info"]["output_token_logprobs"]]
    assert logprobs and all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    if sampling.get("temperature") == 1e-38:
        assert logprobs == [0.0] * len(logprobs)


def test_client_disconnect_aborts_the_request(embedded_server):
    """A client that goes away (stream or not) leaves nothing running on the server."""
    body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}

    async def drained(http) -> bool:
        for _ in range(600):
            if (await http.get("/model_info")).json()["num_running_requests"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    async def main():
        async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as http:
            async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as doomed:
                async with doomed.stream(
                    "POST", "/generate", json={**body, "stream": True, "rid": "dc-s"}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # leave mid-stream
            after_stream = await drained(http)
            async with httpx.AsyncClient(base_url=embedded_server.url, timeout=60) as doomed:
                task = asyncio.create_task(doomed.post("/generate", json={**body, "rid": "dc-n"}))
                await _running(http)
                task.cancel()
            return after_stream, await drained(http)

    assert run(main()) == (True, True)


def _chunks(data: bytes, size: int = 1 << 16):
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_gets_413(embedded_server, path, chunked):
    """A body over max_request_bytes (4 MiB by default) is refused, declared up front or not."""
    body = json.dumps({"text": "x" * (5 << 20)}).encode()
    content = _chunks(body) if chunked else body
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{embedded_server.url}{path}", content=content, headers=headers, timeout=60)
    assert response.status_code == 413
    assert "4194304" in response.json()["error"]["message"]
    ok = httpx.post(
        f"{embedded_server.url}/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
        timeout=60,
    )
    assert ok.status_code == 200
