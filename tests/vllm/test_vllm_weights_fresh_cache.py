"""After a push, no request reuses prompt cache computed under an older version, whatever the pause mode: a
prompt cached before the push is computed afresh under the new weights, with the trainer's logprobs."""

from __future__ import annotations

import httpx
import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.serverkinds.vllm import VLLMClient
from tests.vllm.conftest import metric, run
from tests.vllm.test_vllm_weights import Policy, publish, served_version

# Three whole KV blocks of the CPU build (128 tokens each) and a few more: what the prefix cache can hold.
PROMPT = [3 + (i * 37) % 240 for i in range(400)]
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def policy(vllm_server, vllm_model):
    """The trainer's model, moved by these tests; the checkpoint's own weights are pushed back after them
    (the session's server is shared; test_vllm_generate.py, which runs before, expects version 0)."""
    yield Policy(vllm_model)
    url = vllm_server.url
    assert publish(url, served_version(url) + 1, Policy(vllm_model).tensors()).ok == [url]


def generate(url: str):
    async def go():
        c = VLLMClient(url, api="generate", timeout_s=300)
        try:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
        finally:
            await c.aclose()

    return run(go())


def reference(policy: Policy, output_ids: list[int]) -> torch.Tensor:
    """What a fresh server with the trainer's weights gives those tokens: the trainer's own forward."""
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(policy.model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
    return logp.gather(1, torch.tensor(output_ids)[:, None])[:, 0]


@pytest.mark.parametrize("mode", ["in_place", "abort", "retract"])
def test_a_prompt_cached_before_a_push_is_computed_afresh_after_it(vllm_server, policy, mode):
    url = vllm_server.url
    v = served_version(url) + 1
    assert publish(url, v, policy.tensors(), pause_mode=mode).ok == [url]
    generate(url)
    hits = metric(url, HITS)
    cached = generate(url)
    assert metric(url, HITS) - hits >= 384  # the prompt's whole blocks came from the cache: it is in use
    assert torch.allclose(
        torch.tensor(cached.logprobs), reference(policy, cached.output_ids), atol=1e-4, rtol=0
    )

    policy.step(seed=11)
    assert publish(url, v + 1, policy.tensors(), pause_mode=mode).ok == [url]
    hits = metric(url, HITS)
    after = generate(url)
    assert metric(url, HITS) == hits  # nothing came from the older version's cache
    assert after.versions == [v + 1] * len(after.output_ids)
    assert torch.allclose(
        torch.tensor(after.logprobs), reference(policy, after.output_ids), atol=1e-4, rtol=0
    )


def test_without_the_clear_a_pause_keeps_the_cache_and_the_check_above_would_see_it(vllm_server):
    """The check's teeth: a pause that does not clear (``clear_cache=false``) leaves the prompt's blocks for
    the next request, which the hit counter shows; every pause Slipstream sends clears (serverapi/vllm.py)."""
    url = vllm_server.url
    generate(url)
    token = {"Authorization": f"Bearer {vllm_server.token}"} if getattr(vllm_server, "token", "") else {}
    assert httpx.post(
        f"{url}/pause", params={"mode": "keep", "clear_cache": "false"}, headers=token
    ).is_success
    assert httpx.post(f"{url}/resume", headers=token).is_success
    hits = metric(url, HITS)
    generate(url)
    assert metric(url, HITS) - hits >= 384
