"""Against a real vLLM server: with top-k / top-p on, the trainer's logprobs of vLLM's tokens equal vLLM's
processed logprobs (``--logprobs-mode processed_logprobs``, which Slipstream launches it with) within 1e-4 in
fp32, and without the trainer's replay of the filter they are far off.

vLLM's CPU build does not return the kept set itself (its ``sampling_mask`` comes from the Model Runner V2
sampler, GPU builds only), so the trainer rebuilds it from its own logits (``trainer/logprobs.py``, "Sampling
masks": top-k then top-p in vLLM's arithmetic, the sampled token always kept, a tie at the top-p cut kept
whole). The served weights are pushed here first (the policy of ``sampling_mask_helpers.sharpened``: peaked
enough for top-p 0.8 to cut), and the checkpoint's own weights are pushed back after.
"""

from __future__ import annotations

import httpx
import pytest

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients.base import parse_version
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher
from tests.trainer.sampling_mask_helpers import SETTINGS, TrainerView, compare, sharpened
from tests.vllm.conftest import run

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8], [11, 12, 13], [40, 41, 42, 43, 44], [7]]


def served_version(url: str) -> int:
    return parse_version(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def publish(url: str, tensors) -> None:
    cfg = WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=60, device="cpu")
    pub = WeightPublisher(cfg, [url], server_kind("vllm"))
    try:
        version = served_version(url) + 1
        report = pub.publish(version, tensors)
        assert report.ok == [url], report.failed
    finally:
        pub.close()


@pytest.fixture(scope="module")
def sharp_served(vllm_server, vllm_model, tmp_path_factory):
    view = TrainerView(sharpened(vllm_model, tmp_path_factory.mktemp("vllm-sharp")))
    publish(vllm_server.url, view.tensors())
    yield view
    publish(vllm_server.url, TrainerView(vllm_model).tensors())


def generate(url: str, temperature: float, top_k: int, top_p: float):
    async def go():
        client = VLLMClient(url, api="generate", timeout_s=300)
        params = SamplingParams(
            max_new_tokens=48, temperature=temperature, top_k=top_k, top_p=top_p, ignore_eos=True
        )
        try:
            return [await client.generate(p, params) for p in PROMPTS]
        finally:
            await client.aclose()

    return run(go())


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_trainer_logprobs_equal_vllms_processed_logprobs(
    vllm_server, sharp_served, temperature, top_k, top_p
):
    outs = generate(vllm_server.url, temperature, top_k, top_p)
    errors = [
        compare(sharp_served, p, o.output_ids, o.logprobs, temperature, top_k, top_p)
        for p, o in zip(PROMPTS, outs, strict=True)
    ]
    worst = {k: max(e[k] for e in errors) for k in errors[0]}
    print(f"vllm T={temperature} top_k={top_k} top_p={top_p}: {worst}")
    assert worst["chunked"] <= 1e-4 and worst["plain"] <= 1e-4, worst
    assert worst["no_replay"] > 0.1, worst
