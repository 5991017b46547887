"""Delta and LoRA adapter-only versions on the real embedded server (a tiny random Llama): what it
generates after each equals what it generates after a whole push of the same weights, and differs from the
version before (so the comparison can fail). The bit-for-bit checks of the served tensors are in
test_send_less.py (servers that report a digest of every tensor); this one runs the embedded server's own
apply path. The server runs in fp32: in bf16 a random tiny model's greedy choices meet exact ties whose
outcome depends on the server's earlier requests, which would make the comparison flaky for reasons of
its own."""

from __future__ import annotations

import httpx
import pytest
import torch

from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.delta import merge_lora
from slipstream.weightsync.publisher import WeightPublisher, publish_lora

PROMPTS = [[5, 77, 101, 33, 8], [40, 41, 42], [200, 3, 17, 17, 90, 6]]


def config(group: str, **kw) -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="torch_dist", bucket_mb=1, timeout_s=30, device="cpu", group_name=group, **kw
    )


def probe(url: str) -> tuple[str, list]:
    """The version served and its greedy continuations of a few prompts."""
    outs = []
    for prompt in PROMPTS:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }
        outs.append(httpx.post(f"{url}/generate", json=body, timeout=120).json())
    return outs[0]["meta_info"]["weight_version"], [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
    from slipstream.rollouter.launch import launch_server

    engine_cfg = EmbeddedServerConfig(
        num_threads=1, max_model_len=512, kv_cache_tokens=4096, seed=0, dtype="float32"
    )
    srv = launch_server(server_kind("embedded"), tiny_model_path, cfg=RolloutConfig(embedded=engine_cfg))
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def weights(tiny_model_path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return [(n, p.detach().mul(-1.5)) for n, p in model.named_parameters()]


def nudged(named, seed: int):
    """A few elements of every tensor take new values (a delta of about 2% of the model), enough to
    change what the model generates."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = (torch.randn(idx.shape, generator=g) * 0.5).to(t.dtype)
        out.append((name, t))
    return out


def test_a_delta_version_serves_exactly_what_a_whole_push_of_it_serves(server, weights):
    v1, v2 = weights, nudged(weights, 2)
    pub = WeightPublisher(config("delta", delta=True), [server.url], server_kind("embedded"))
    try:
        assert pub.publish(1, iter(v1)).sent == "full"
        first = probe(server.url)
        report = pub.publish(2, iter(v2))
        assert report.ok == [server.url] and report.sent == "delta", report
        assert report.bytes < report.dense_bytes
        after_delta = probe(server.url)
    finally:
        pub.close()
    whole = WeightPublisher(config("whole"), [server.url], server_kind("embedded"))
    try:
        assert whole.publish(3, iter(v2)).sent == "full"
        after_whole = probe(server.url)
    finally:
        whole.close()
    assert first[0] == "1" and after_delta[0] == "2" and after_whole[0] == "3"
    assert after_delta[1] == after_whole[1]  # the same continuations
    assert after_delta[1] != first[1]


def lora_adapters(weights, seed: int, rank: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, w in weights:
        module = name.removesuffix(".weight")
        if module.endswith(("q_proj", "v_proj", "down_proj")):
            a = (torch.randn(rank, w.shape[1], generator=g) * 0.1).to(w.dtype)
            b = (torch.randn(w.shape[0], rank, generator=g) * 0.1).to(w.dtype)
            out += [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)]
    return out


def test_an_adapter_only_version_serves_exactly_the_merged_policy_a_whole_push_serves(server, weights):
    scale = 2.0
    pub = WeightPublisher(config("lora"), [server.url], server_kind("embedded"))
    try:
        report = publish_lora(pub, 4, lambda: iter(lora_adapters(weights, 4)), lambda: iter(weights), scale)
        assert report is not None and report.sent == "lora" and report.ok == [server.url]
        first = probe(server.url)
        adapters = lora_adapters(weights, 5)
        report = publish_lora(pub, 5, lambda: iter(adapters), lambda: pytest.fail("base gathered"), scale)
        assert report is not None and report.sent == "adapters" and report.ok == [server.url]
        assert report.bytes < 0.2 * sum(t.numel() * t.element_size() for _, t in weights)
        after_adapters = probe(server.url)
    finally:
        pub.close()
    ad = dict(adapters)
    merged = []
    for name, w in weights:
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in ad:
            w = merge_lora(w, ad[f"{module}.lora_A.weight"], ad[f"{module}.lora_B.weight"], scale)
        merged.append((name, w))
    whole = WeightPublisher(config("lora-whole"), [server.url], server_kind("embedded"))
    try:
        assert whole.publish(6, iter(merged)).ok == [server.url]
        after_whole = probe(server.url)
    finally:
        whole.close()
    assert after_adapters[1] == after_whole[1]
    assert after_adapters[1] != first[1]
