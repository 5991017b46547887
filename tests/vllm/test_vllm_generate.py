"""Token-in/token-out generation, abort and every pause mode against a real vLLM server."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients import client_for
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient
from tests.vllm.conftest import LONG_TOKENS, generated, run, start_long, wait_for_tokens

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8]
LONG = SamplingParams(max_new_tokens=LONG_TOKENS, ignore_eos=True)


def client(server, route: str = "generate") -> VLLMClient:
    return VLLMClient(server.url, api=route, timeout_s=300)


@pytest.mark.parametrize("route", ["generate", "completions"])
def test_generate_returns_tokens_logprobs_and_versions(vllm_server, route):
    async def go():
        c = client(vllm_server, route)
        try:
            return await c.generate(
                PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True), rid=f"r-{route}"
            )
        finally:
            await c.aclose()

    out = run(go())
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == 12
    assert out.finish_reason == "length"
    assert all(lp <= 0.0 for lp in out.logprobs)
    assert out.versions == [0] * 12  # vLLM's "default" version is our 0
    assert out.prompt_tokens == len(PROMPT)


def test_logprobs_equal_teacher_forced_transformers(vllm_server, vllm_model):
    """vLLM's logprobs of what it sampled (temperature 1: the model's own distribution) are those of a
    transformers forward pass over the same tokens, in fp32."""
    from transformers import AutoModelForCausalLM

    async def go():
        c = client(vllm_server)
        try:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))
        finally:
            await c.aclose()

    out = run(go())
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    ids = torch.tensor([PROMPT + out.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
    expected = logp.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("route", ["generate", "completions"])
def test_abort_returns_the_partial_output(vllm_server, route):
    async def go():
        c = client(vllm_server, route)
        try:
            task = await start_long(vllm_server.url, lambda: c.generate(PROMPT, LONG, rid=f"abort-{route}"))
            await c.abort(f"abort-{route}")
            return await task
        finally:
            await c.aclose()

    out = run(go())
    assert out.finish_reason == "abort"
    assert 0 < len(out.output_ids) < LONG.max_new_tokens
    assert len(out.logprobs) == len(out.versions) == len(out.output_ids)


def test_pause_abort_ends_running_requests_and_holds_new_ones(vllm_server):
    async def go():
        c = client(vllm_server)
        try:
            running = await start_long(vllm_server.url, lambda: c.generate(PROMPT, LONG, rid="paused-abort"))
            await c.pause("abort")
            partial = await running
            held = asyncio.create_task(c.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)))
            paused_tokens = generated(vllm_server.url)
            await asyncio.sleep(0)  # the held request is sent; it must not run before resume
            assert not held.done()
            assert generated(vllm_server.url) == paused_tokens
            await c.resume()
            return partial, await held
        finally:
            await c.aclose()

    partial, after = run(go())
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < LONG.max_new_tokens
    assert after.finish_reason == "length" and len(after.output_ids) == 4


def test_pause_in_place_keeps_running_requests(vllm_server):
    """The request stays on the server through the pause and goes on making tokens after resume."""

    async def go():
        c = client(vllm_server)
        try:
            running = await start_long(vllm_server.url, lambda: c.generate(PROMPT, LONG, rid="in-place"))
            await c.pause("in_place")
            paused_at = generated(vllm_server.url)
            assert not running.done()
            await c.resume()
            await wait_for_tokens(vllm_server.url, paused_at)
            await c.abort("in-place")
            return await running
        finally:
            await c.aclose()

    out = run(go())
    assert out.finish_reason == "abort"  # the test's own abort: the pause ended nothing
    assert len(out.output_ids) > 0 and len(out.output_ids) == len(out.versions)


def test_pause_wait_lets_running_requests_finish(vllm_server):
    async def go():
        c = client(vllm_server)
        try:
            before = generated(vllm_server.url)
            sampling = SamplingParams(max_new_tokens=100, ignore_eos=True)
            running = asyncio.create_task(c.generate(PROMPT, sampling, rid="wait"))
            await wait_for_tokens(vllm_server.url, before)
            await c.pause("wait")
            await asyncio.wait_for(asyncio.shield(running), 120)  # finishes while paused
            await c.resume()
            return await running
        finally:
            await c.aclose()

    out = run(go())
    assert out.finish_reason == "length" and len(out.output_ids) == 100


def test_client_built_from_the_rollout_config_uses_its_route(vllm_server):
    cfg = vllm_server.cfg
    c = client_for(server_kind("vllm"), cfg, vllm_server.url)
    assert isinstance(c, VLLMClient) and c.route == cfg.vllm.route == "generate"
    assert run(c.health())
    run(c.aclose())


def test_the_servers_counters_show_a_shared_prompt_served_from_the_prefix_cache(vllm_server):
    """A group's later samples reuse the prompt's whole KV blocks (128 tokens each on the CPU build), and the
    server's own counters, which the run reports as server/*, say so."""
    shared = [(7 * i) % 250 + 3 for i in range(300)]  # two whole blocks and a partial one

    async def go():
        c = client(vllm_server)
        try:
            before = await c.engine_counters()
            await c.generate(shared, SamplingParams(max_new_tokens=2, ignore_eos=True))
            await c.generate(shared, SamplingParams(max_new_tokens=2, ignore_eos=True))
            return before, await c.engine_counters()
        finally:
            await c.aclose()

    before, after = run(go())
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * len(shared)
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * len(shared)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 256  # the second one's two blocks
    assert after["generated_tokens"] - before["generated_tokens"] == 4
    assert after["decode_requests"] - before["decode_requests"] == 2
