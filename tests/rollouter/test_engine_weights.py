"""The embedded engine in this process (served over loopback HTTP too): weight updates and logprob fidelity.

The engine and its uvicorn server run on an event loop in a background thread, so the test thread can call
``apply_weights`` directly (the in-process API the weight-sync receiver uses) while HTTP requests run.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

import httpx
import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.embedded.app import build_app
from slipstream.rollouter.embedded.engine import EmbeddedEngine
from slipstream.serverkinds.sglang import SGLangClient
from slipstream.utils.net import free_port
from slipstream.weightsync.types import WeightTarget
from tests.rollouter.conftest import TEST_ENGINE, run


class LiveServer:
    def __init__(self, model_path) -> None:
        import uvicorn

        torch.set_num_threads(1)
        self.engine = EmbeddedEngine(model_path, TEST_ENGINE, weight_version=0)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(build_app(self.engine), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        for _ in range(1200):
            if self.server.started:
                break
            if self.serving.done():
                self.serving.result()  # raises what stopped the server
            threading.Event().wait(0.05)
        assert self.server.started, "the in-process server did not start"

    def call(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.server.should_exit = True
        self.serving.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def live(tiny_model_path):
    server = LiveServer(tiny_model_path)
    yield server
    server.close()


def _lm_head(engine: EmbeddedEngine) -> torch.Tensor:
    return engine.model.get_output_embeddings().weight


def teacher_logprobs(engine, prompt, output, temperature, top_k=None) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()[len(prompt) - 1 : -1]
    scores = logits / temperature
    if top_k is not None:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.log_softmax(scores, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_engine_is_a_weight_target(live):
    specs = live.engine.weight_specs()
    assert isinstance(live.engine, WeightTarget)
    assert specs["lm_head.weight"] == (tuple(_lm_head(live.engine).shape), torch.float32)


def test_logprobs_match_teacher_forcing_across_sampling_settings(live):
    engine = live.engine
    settings = [(1.0, -1), (0.6, -1), (1.3, -1), (1.0, 5)]

    async def main():
        states = []
        for i, (temperature, top_k) in enumerate(settings):
            params = SamplingParams(max_new_tokens=20, temperature=temperature, top_k=top_k)
            states.append(await engine.submit([11, 12, 13 + i], params, rid=f"fid-{i}", ignore_eos=True))
        return [await engine.wait(s) for s in states]

    states = live.call(main())
    for (temperature, top_k), state in zip(settings, states, strict=True):
        expected = teacher_logprobs(
            engine, state.input_ids, state.output_ids, temperature, None if top_k < 0 else top_k
        )
        assert torch.allclose(torch.tensor(state.logprobs), expected, atol=1e-4), (temperature, top_k)


def test_chunked_prefill_of_long_prompts_is_faithful(live):
    """Prompts longer than max_batch_tokens (512 here) are prefilled in chunks that attend to their prefix."""
    engine = live.engine
    prompts = [[(7 * i) % 250 + 1 for i in range(700)], [(3 * i) % 250 + 1 for i in range(90)], [4, 5]]

    async def main():
        params = SamplingParams(max_new_tokens=12, temperature=0.9)
        states = [
            await engine.submit(p, params, rid=f"long-{i}", ignore_eos=True) for i, p in enumerate(prompts)
        ]
        return [await engine.wait(s) for s in states]

    for state in live.call(main()):
        expected = teacher_logprobs(engine, state.input_ids, state.output_ids, 0.9)
        assert torch.allclose(torch.tensor(state.logprobs), expected, atol=1e-4), len(state.input_ids)


def test_in_place_update_mid_request_restamps_later_tokens(live):
    engine = live.engine
    original = _lm_head(engine).detach().clone()
    uniform = -math.log(original.shape[0])
    body = {
        "input_ids": [21, 22, 23],
        "sampling_params": {"max_new_tokens": 120, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    chunks = []
    with httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/generate", json=body) as response:
            updated = False
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line[6:]))
                if not updated and len(chunks[-1]["output_ids"]) >= 10:
                    updated = True
                    http.post("/pause_generation", json={"mode": "in_place"})
                    engine.apply_weights([("lm_head.weight", torch.zeros_like(original))], version=1)
                    http.post("/continue_generation", json={})
        info = http.get("/model_info").json()

    meta = chunks[-1]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    boundary = spans[0]["end"]
    assert spans == [
        {"version": "0", "start": 0, "end": boundary},
        {"version": "1", "start": boundary, "end": 120},
    ]
    assert 10 <= boundary < 120
    logprobs = [t[0] for t in meta["output_token_logprobs"]]
    # Every token stamped 1 came from the zeroed head (uniform), every token stamped 0 from the old one.
    assert all(abs(lp - uniform) < 1e-5 for lp in logprobs[boundary:])
    assert all(abs(lp - uniform) > 1e-5 for lp in logprobs[:boundary])
    assert meta["weight_version"] == "1" and info["weight_version"] == "1"

    async def after():
        client = SGLangClient(live.url)
        try:
            return await client.weight_version(), await client.generate(
                [5, 6], SamplingParams(max_new_tokens=5)
            )
        finally:
            await client.aclose()

    version, out = run(after())
    assert version == 1 and out.versions == [1] * len(out.output_ids)
    assert all(abs(lp - uniform) < 1e-5 for lp in out.logprobs)
    engine.apply_weights([("lm_head.weight", original)], version=2)
    assert torch.equal(_lm_head(engine), original) and engine.weight_version == 2


@pytest.mark.parametrize(
    ("named", "version", "fragment"),
    [
        ([("model.no_such.weight", torch.zeros(2))], 9, "unknown parameter"),
        ([("lm_head.weight", torch.zeros(3, 3))], 9, "has shape"),
        ([("lm_head.weight", torch.zeros(1, dtype=torch.int64))], 9, "shape"),
        ([("lm_head.weight", None)], 0, "older than"),
    ],
)
def test_apply_weights_validates_everything_before_copying(live, named, version, fragment):
    engine = live.engine
    head = _lm_head(engine)
    before, before_version = head.detach().clone(), engine.weight_version
    # A valid tensor first: it must not be applied when a later one is rejected.
    valid = ("lm_head.weight", torch.ones_like(before))
    named = [(n, torch.zeros_like(before) if t is None else t) for n, t in named]
    with pytest.raises(ValueError, match=fragment):
        engine.apply_weights([valid, *named], version=version)
    assert torch.equal(head, before) and engine.weight_version == before_version


def test_abort_pause_update_and_continue(live):
    engine = live.engine
    new_version = engine.weight_version + 1

    async def main():
        client = SGLangClient(live.url)
        try:
            long = asyncio.create_task(
                client.generate([1, 2], SamplingParams(max_new_tokens=900), rid="ab-1")
            )
            while engine.num_running == 0:
                await asyncio.sleep(0.02)
            await client.pause("abort")
            aborted = await long
            held = asyncio.create_task(client.generate([3], SamplingParams(max_new_tokens=4), rid="ab-2"))
            await asyncio.to_thread(
                engine.apply_weights, list(engine.model.named_parameters())[:1], new_version
            )
            await client.resume()
            return aborted, await held
        finally:
            await client.aclose()

    aborted, held = run(main())
    assert aborted.finish_reason in ("abort", "stop") and len(aborted.output_ids) < 900
    assert held.versions == [new_version] * len(held.output_ids)


class _RecordingStream:
    """Stands in for the generation loop's stream: records what had happened when it was synchronised."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.seen: list[tuple[int, torch.Tensor]] = []

    def synchronize(self) -> None:
        self.seen.append((self.engine.weight_version, _lm_head(self.engine).detach().clone()))


def test_weight_switch_synchronises_the_generation_stream_before_the_new_version(live, monkeypatch):
    engine = live.engine
    original = _lm_head(engine).detach().clone()
    before = engine.weight_version
    stream = _RecordingStream(engine)
    monkeypatch.setattr(engine, "_generation_stream", lambda: stream)
    engine.apply_weights([("lm_head.weight", original + 1.0)], version=before + 1)
    # Synchronised once, after every copy was queued and before the version (and its stamp) moved.
    assert len(stream.seen) == 1
    version, head = stream.seen[0]
    assert version == before and torch.equal(head, original + 1.0)
    assert engine.weight_version == before + 1
    engine.apply_weights([("lm_head.weight", original)], version=before + 2)
    assert torch.equal(_lm_head(engine), original)


def test_decode_steps_attend_per_request(live, monkeypatch):
    """transformers must route continuous batching to attention.py (5.24 stopped passing ``cache=``)."""
    from slipstream.rollouter.embedded import attention

    calls = []
    looped = attention.looped_varlen_sdpa
    monkeypatch.setattr(
        attention, "looped_varlen_sdpa", lambda *a, **k: calls.append(a[3].numel() - 1) or looped(*a, **k)
    )
    engine = live.engine

    async def main():
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        states = [await engine.submit([9, 8, 7 + i], params, rid=f"route-{i}") for i in range(3)]
        return [await engine.wait(s) for s in states]

    live.call(main())
    assert calls and max(calls) >= 2  # steps that held several requests went through the per-request kernel


def test_batched_attention_gives_the_loops_tokens_and_faithful_logprobs(live, monkeypatch):
    """The accelerator path (one masked call, no host reads) forced on CPU: same greedy tokens, same logprobs."""
    from slipstream.rollouter.embedded import attention

    engine = live.engine
    prompts = [[31, 32, 33], [40, 41, 42, 43, 44, 45, 46], [50]]

    async def main(tag: str, temperature: float):
        params = SamplingParams(max_new_tokens=16, temperature=temperature)
        states = [
            await engine.submit(p, params, rid=f"{tag}-{i}", ignore_eos=True) for i, p in enumerate(prompts)
        ]
        return [await engine.wait(s) for s in states]

    looped_greedy = live.call(main("loop", 0.0))
    batched_calls = []
    batched = attention.batched_varlen_sdpa
    monkeypatch.setattr(attention, "LOOP_DEVICES", frozenset())
    monkeypatch.setattr(
        attention, "batched_varlen_sdpa", lambda *a, **k: batched_calls.append(1) or batched(*a, **k)
    )
    batched_greedy = live.call(main("batched", 0.0))
    sampled = live.call(main("batched-t", 0.8))
    assert batched_calls
    assert [s.output_ids for s in batched_greedy] == [s.output_ids for s in looped_greedy]
    for state in sampled:
        expected = teacher_logprobs(engine, state.input_ids, state.output_ids, 0.8)
        assert torch.allclose(torch.tensor(state.logprobs), expected, atol=1e-4)


def test_filter_counts_follow_requests_in_flight(live):
    engine = live.engine

    async def main():
        params = SamplingParams(max_new_tokens=200, temperature=1.0, top_k=5)
        state = await engine.submit([3, 4, 5], params, rid="filters-1", ignore_eos=True)
        during = (engine._filters.top_k, engine._filters.top_p)
        engine.abort("filters-1")
        await engine.wait(state)
        plain = await engine.submit([3, 4], SamplingParams(max_new_tokens=3), rid="filters-2")
        await engine.wait(plain)
        return during, (engine._filters.top_k, engine._filters.top_p)

    during, after = live.call(main())
    assert during == (1, 0) and after == (0, 0)
