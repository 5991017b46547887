"""Pushes carry the dtype the servers serve: 2 bytes a parameter for a bf16 server, whatever the trainer
keeps (fp32 here), and `weightsync.push_dtype: auto` resolves from the server's own settings."""

from __future__ import annotations

import json

from slipstream.config import load_config
from slipstream.pipeline import Pipeline
from slipstream.pipeline.modes import prepare_config, served_dtype
from tests.pipeline.conftest import pipeline_config


def test_auto_resolves_to_what_each_backend_serves(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    embedded = load_config(None, ["rollout.embedded.dtype=float16"])
    assert served_dtype(embedded) == "float16"
    vllm = load_config(None, [f"model.path={model}", "rollout.backend=vllm"])
    assert served_dtype(vllm) == "bfloat16"  # the checkpoint's, as vLLM loads it
    told = load_config(
        None, [f"model.path={model}", "rollout.backend=sglang", "rollout.server_args=[--dtype=half]"]
    )
    assert served_dtype(told) == "float16"
    assert prepare_config(embedded)[0].weightsync.push_dtype == "float16"
    # vLLM is started with --dtype rollout.vllm.dtype; a --dtype in rollout.server_args comes after it and wins
    vllm_told = load_config(
        None, [f"model.path={model}", "rollout.backend=vllm", "rollout.vllm.dtype=float16"]
    )
    assert served_dtype(vllm_told) == "float16"
    assert prepare_config(vllm_told)[0].weightsync.push_dtype == "float16"
    overridden = load_config(
        None,
        [
            f"model.path={model}",
            "rollout.backend=vllm",
            "rollout.vllm.dtype=float16",
            "rollout.server_args=[--dtype=float32]",
        ],
    )
    assert served_dtype(overridden) == "float32"
    pinned = load_config(None, ["rollout.embedded.dtype=float16", "weightsync.push_dtype=float32"])
    assert prepare_config(pinned)[0].weightsync.push_dtype == "float32"


def test_a_bf16_server_receives_two_bytes_a_parameter_from_an_fp32_trainer(
    ray_pools, tiny_model_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    cfg = pipeline_config(tmp_path, tiny_model_path, "async.mode=sync", "run.total_steps=2", "rollout.embedded.dtype=bfloat16",
                          prompts=4)  # fmt: skip
    result = Pipeline(cfg).run()
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync/bytes"] for r in records] == [2 * params] * 2
    assert all(r["sync/servers_ok"] == 1.0 for r in records)
