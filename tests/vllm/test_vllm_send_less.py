"""Send-less versions into a real vLLM server: a delta (only the changed elements) and a LoRA adapter-only
version, rebuilt inside vLLM by the ``slipstream`` engine's receiver. vLLM's logprobs after each equal a
transformers pass over the weights a whole push would have installed."""

from __future__ import annotations

import httpx
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients.base import parse_version
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.delta import merge_lora
from slipstream.weightsync.publisher import WeightPublisher, publish_lora
from tests.vllm.conftest import run

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8]


def config(group: str, **kw) -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="torch_dist", bucket_mb=1, timeout_s=60, device="cpu", group_name=group, **kw
    )


def served_version(url: str) -> int:
    return parse_version(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def base_weights(path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def serves(url: str, path, named: list[tuple[str, torch.Tensor]]) -> None:
    """vLLM's logprobs for what it samples equal a transformers pass with ``named`` loaded."""
    from transformers import AutoModelForCausalLM

    async def go():
        c = VLLMClient(url, api="generate", timeout_s=300)
        try:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))
        finally:
            await c.aclose()

    out = run(go())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(dict(named), strict=True)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def nudged(named, seed: int):
    """About 2% of every tensor's elements take new values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = torch.randn(idx.shape, generator=g) * 0.1
        out.append((name, t))
    return out


def test_a_delta_version_serves_the_same_weights_as_a_whole_push(vllm_server, vllm_model):
    v = served_version(vllm_server.url)
    whole, changed = nudged(base_weights(vllm_model), v), None
    pub = WeightPublisher(config(f"delta-{v}", delta=True), [vllm_server.url], server_kind("vllm"))
    try:
        assert pub.publish(v + 1, iter(whole)).sent == "full"
        changed = nudged(whole, v + 1)
        report = pub.publish(v + 2, iter(changed))
        assert report.ok == [vllm_server.url] and report.sent == "delta", report
        assert report.bytes < report.dense_bytes
    finally:
        pub.close()
    assert served_version(vllm_server.url) == v + 2
    serves(vllm_server.url, vllm_model, changed)


def adapters(weights, seed: int, rank: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, w in weights:
        module = name.removesuffix(".weight")
        if module.endswith(("q_proj", "v_proj", "down_proj")):
            out += [
                (f"{module}.lora_A.weight", torch.randn(rank, w.shape[1], generator=g) * 0.1),
                (f"{module}.lora_B.weight", torch.randn(w.shape[0], rank, generator=g) * 0.1),
            ]
    return out


def test_an_adapter_only_version_serves_the_merged_policy(vllm_server, vllm_model):
    v, scale = served_version(vllm_server.url), 2.0
    base = base_weights(vllm_model)
    pub = WeightPublisher(config(f"lora-{v}"), [vllm_server.url], server_kind("vllm"))
    try:
        report = publish_lora(pub, v + 1, lambda: iter(adapters(base, 1)), lambda: iter(base), scale)
        assert report is not None and report.sent == "lora" and report.ok == [vllm_server.url], report
        second = adapters(base, 2)
        report = publish_lora(pub, v + 2, lambda: iter(second), lambda: iter(()), scale)
        assert report is not None and report.sent == "adapters" and report.ok == [vllm_server.url], report
        assert report.bytes < 0.5 * sum(t.numel() * t.element_size() for _, t in base)
    finally:
        pub.close()
    ad = dict(second)
    merged = []
    for name, w in base:
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in ad:
            w = merge_lora(w, ad[f"{module}.lora_A.weight"], ad[f"{module}.lora_B.weight"], scale)
        merged.append((name, w))
    assert served_version(vllm_server.url) == v + 2
    serves(vllm_server.url, vllm_model, merged)
