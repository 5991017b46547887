"""Weights pushed into a real vLLM server by Slipstream's publisher, through the ``slipstream`` weight-transfer
engine the package registers in vLLM (gloo on a CPU), and tokens stamped with the version that made them."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients.base import parse_version
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher
from tests.vllm.conftest import LONG_TOKENS, POLL_S, generated, run, start_long, until, wait_for_tokens
from tests.weightsync.wsync_helpers import corrupt_once

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8]
LONG = SamplingParams(max_new_tokens=LONG_TOKENS, ignore_eos=True)


def config(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=60, device="cpu", **kw)


class Policy:
    """The trainer's model: the served checkpoint, moved a little for each version."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)

    def tensors(self):
        return ((n, p.detach().clone()) for n, p in self.model.named_parameters())

    def logprobs(self, output_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(self.model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
        return logp.gather(1, torch.tensor(output_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def policy(vllm_model):
    return Policy(vllm_model)


def served_version(url: str) -> int:
    """What vLLM serves (its "default" before the first push is our 0); other test files push too, so every
    test numbers its versions from here."""
    return parse_version(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def generate(url: str, n: int = 16):
    async def go():
        c = VLLMClient(url, api="generate", timeout_s=300)
        try:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=n, ignore_eos=True))
        finally:
            await c.aclose()

    return run(go())


def publish(url: str, version: int, tensors, **cfg) -> object:
    pub = WeightPublisher(config(**cfg), [url], server_kind("vllm"))
    try:
        return pub.publish(version, tensors)
    finally:
        pub.close()


def test_a_pushed_version_serves_with_the_trainers_logprobs(vllm_server, policy):
    """Served from the shadow copy loaded while the old version served (``rollouter/vllm_shadow.py``):
    swapped in at the switch, then swapped back out for the next version, each with the trainer's logprobs."""
    for step in (1, 2):
        v = served_version(vllm_server.url) + 1
        policy.step(seed=step)
        report = publish(vllm_server.url, v, policy.tensors())
        assert report.ok == [vllm_server.url], report.failed
        assert served_version(vllm_server.url) == v
        out = generate(vllm_server.url)
        assert out.versions == [v] * len(out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), policy.logprobs(out.output_ids), atol=1e-4, rtol=0)
    log = (vllm_server.log_dir / f"vllm-{vllm_server.starts}.log").read_text(errors="replace")
    assert "switched to the staged version" in log
    assert "reload the model in place" not in log  # the dense model on a CPU is double-buffered
    # read back from the served parameters: vLLM's CPU build packs the linear layers away, the rest is compared
    assert re.search(r"read back [1-9]\d* tensors \([1-9]\d* parameters not readable\)", log), log[-2000:]


def test_a_push_that_fails_part_way_leaves_the_old_version_serving(vllm_server, policy):
    v = served_version(vllm_server.url) + 1
    publish(vllm_server.url, v, policy.tensors())
    before = generate(vllm_server.url)

    def dies_part_way():
        for i, item in enumerate(policy.tensors()):
            if i == 5:
                raise RuntimeError("the trainer failed mid-version")
            yield item[0], item[1] + 1.0

    with pytest.raises(RuntimeError, match="mid-version"):  # the trainer's own error reaches it
        publish(vllm_server.url, v + 1, dies_part_way(), keep_last=False)
    assert served_version(vllm_server.url) == v
    after = generate(vllm_server.url)
    assert after.versions == [v] * len(after.output_ids)
    assert torch.allclose(torch.tensor(after.logprobs), policy.logprobs(after.output_ids), atol=1e-4, rtol=0)
    assert before.versions == after.versions
    policy.step(seed=4)  # and the next version goes through
    assert publish(vllm_server.url, v + 2, policy.tensors()).ok == [vllm_server.url]
    assert served_version(vllm_server.url) == v + 2


def test_a_tensor_of_the_wrong_shape_is_refused_by_name(vllm_server, policy):
    serving = served_version(vllm_server.url)

    def bad():
        for name, t in policy.tensors():
            yield name, (t[:-1] if name.endswith("down_proj.weight") else t)

    report = publish(vllm_server.url, serving + 1, bad(), keep_last=False)
    assert vllm_server.url in report.failed and "down_proj" in report.failed[vllm_server.url]
    assert served_version(vllm_server.url) == serving


def test_a_version_missing_a_tensor_is_refused_whole(vllm_server, policy):
    """A sender that drops a tensor gets its version refused, naming it, and the old one keeps serving (it is
    never completed from the weights the server held: that would serve a mix of two versions)."""
    url = vllm_server.url
    serving = served_version(url)
    publish(url, serving + 1, policy.tensors())
    before = generate(url)

    def dropped():
        for name, t in policy.tensors():
            if name != "model.layers.0.mlp.down_proj.weight":
                yield name, t + 1.0

    report = publish(url, serving + 2, dropped(), keep_last=False)
    assert url in report.failed and "misses 1 parameters" in report.failed[url], report.failed
    assert "model.layers.0.mlp.down_proj.weight" in report.failed[url]
    assert served_version(url) == serving + 1
    after = generate(url)
    assert after.versions == [serving + 1] * len(after.output_ids)
    assert torch.allclose(torch.tensor(after.logprobs), policy.logprobs(after.output_ids), atol=1e-4, rtol=0)
    assert before.versions == after.versions


def test_tokens_carry_the_version_that_made_them_when_a_push_lands_mid_request(vllm_server, policy):
    """In place: the request keeps running across the push; its tokens are stamped old then new."""
    old = served_version(vllm_server.url)

    async def go():
        c = VLLMClient(vllm_server.url, api="generate", timeout_s=300)
        try:
            task = await start_long(vllm_server.url, lambda: c.generate(PROMPT, LONG, rid="mid-push"))
            # Frozen where it is until the push resumes it: the push's set-up (a group, a session) can take
            # longer than the whole request on a loaded machine.
            await c.pause("in_place")
            policy.step(seed=old + 1)
            report = await asyncio.to_thread(
                publish, vllm_server.url, old + 1, policy.tensors(), pause_mode="in_place"
            )
            # A short request run to its end on the new version: the long one, running beside it, made
            # tokens in the same engine steps, so it has tokens of the new version whatever the metrics say.
            await c.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
            await c.abort("mid-push")
            return report, await task
        finally:
            await c.aclose()

    report, out = run(go())
    assert report.ok == [vllm_server.url], report.failed
    assert out.finish_reason == "abort"  # the test's, after the push: the push itself aborted nothing
    n = len(out.output_ids)
    switch = out.versions.index(old + 1)
    assert 0 < switch < n
    assert out.versions == [old] * switch + [old + 1] * (n - switch)


def test_an_aborted_request_resumes_on_the_new_version(vllm_server, policy):
    """Abort mode (partial rollouts): the push aborts the request, the rollouter's wrapper re-submits
    prompt + partial output, and the pieces join with each token's version."""
    old = served_version(vllm_server.url)

    async def go():
        c = VLLMClient(vllm_server.url, api="generate", timeout_s=300)
        partial = PartialRolloutClient(c, max_in_flight=4)
        try:
            task = await start_long(vllm_server.url, lambda: partial.generate(PROMPT, LONG, rid="resumed"))
            await c.pause("in_place")  # frozen until the push aborts it (as above)
            policy.step(seed=old + 1)
            report = await asyncio.to_thread(
                publish, vllm_server.url, old + 1, policy.tensors(), pause_mode="abort"
            )
            # The wrapper re-submits once the aborted piece's response is back (its tokens counted by then);
            # any token after that is the resumed request's, so it is on the server when the abort goes out.
            await until(lambda: partial.resumes >= 1)
            await wait_for_tokens(vllm_server.url, generated(vllm_server.url))
            await partial.abort("resumed")
            return report, await task
        finally:
            await c.aclose()

    report, out = run(go())
    assert report.ok == [vllm_server.url], report.failed
    assert out.finish_reason == "abort" and out.num_resumes >= 1
    n = len(out.output_ids)
    switch = out.versions.index(old + 1)
    assert 0 < switch < n
    assert out.versions == [old] * switch + [old + 1] * (n - switch)


def test_buckets_stage_while_the_server_generates(vllm_server, policy, monkeypatch):
    """Our engine receives a version's buckets in band while vLLM keeps generating, and pauses only for the
    switch: the version's one start call returns before a byte of it is sent, no call is made per bucket,
    and the server generates tokens before the sender sends the first one. (An engine that received inside
    a call would block the server until the bytes came: the call would never return and the sender would
    give up at its bound.)"""
    from slipstream.serverkinds.vllm import VLLMAdapter
    from slipstream.weightsync.groups import DistGroup

    url = vllm_server.url
    old = served_version(url)
    publish(url, old + 1, policy.tensors())  # joins the group: every broadcast below is a bucket's
    returned = threading.Event()
    tokens_at_return: list[float] = []
    real_before, real_broadcast = VLLMAdapter.before, DistGroup.broadcast_async
    calls: list[str] = []
    real_request = VLLMAdapter.request

    async def request(self, call, **kw):
        calls.append(call.path)
        return await real_request(self, call, **kw)

    async def before(self, version, stream=None):
        await real_before(self, version, stream)
        if not returned.is_set():
            tokens_at_return.append(await asyncio.to_thread(generated, self.url))
            returned.set()

    def broadcast_async(self, tensor):  # the sender's thread, before each part of a bucket goes out
        assert returned.wait(120), "the start call did not return before the first bucket was sent"
        deadline = time.monotonic() + 120
        while generated(url) <= tokens_at_return[0]:
            assert time.monotonic() < deadline, "the server generated nothing while the bucket was pending"
            time.sleep(POLL_S)
        return real_broadcast(self, tensor)

    monkeypatch.setattr(VLLMAdapter, "before", before)
    monkeypatch.setattr(VLLMAdapter, "request", request)
    monkeypatch.setattr(DistGroup, "broadcast_async", broadcast_async)

    async def go():
        c = VLLMClient(url, api="generate", timeout_s=300)
        try:
            task = await start_long(url, lambda: c.generate(PROMPT, LONG, rid="beside-push"))
            policy.step(seed=old + 2)
            report = await asyncio.to_thread(publish, url, old + 2, policy.tensors(), pause_mode="in_place")
            # run beside a short request to its end: the long one has tokens of the new version then
            await c.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
            await c.abort("beside-push")
            return report, await task
        finally:
            await c.aclose()

    report, out = run(go())
    assert report.ok == [url], report.failed
    assert 0 < report.paused_s < report.seconds  # paused for the switch only
    assert served_version(url) == old + 2
    assert out.versions[0] == old + 1 and out.versions[-1] == old + 2
    assert calls.count("/update_weights") == 1  # the switch: the buckets came without a call each


def test_a_version_corrupted_on_the_way_fails_verification_and_the_old_one_keeps_serving(
    vllm_server, policy, monkeypatch
):
    """A byte flipped after the trainer digested it: vLLM's receiver refuses the version, naming the tensor,
    and serves the old one with the trainer's logprobs; the publisher counts it (``sync/verify_failed``)."""
    url = vllm_server.url
    serving = served_version(url)
    publish(url, serving + 1, policy.tensors())
    corrupt = corrupt_once(monkeypatch, version=serving + 2)
    report = publish(url, serving + 2, (({n: t + 1.0 for n, t in policy.tensors()}).items()), keep_last=False)
    assert corrupt.name is not None and report.verify_failed == 1
    assert url in report.failed and f"`{corrupt.name}` failed verification" in report.failed[url]
    assert served_version(url) == serving + 1
    after = generate(url)
    assert after.versions == [serving + 1] * len(after.output_ids)
    assert torch.allclose(torch.tensor(after.logprobs), policy.logprobs(after.output_ids), atol=1e-4, rtol=0)
