"""Pushes carry the dtype the servers serve: 2 bytes a parameter for a bf16 server, whatever the trainer
keeps (fp32 here), and `weightsync.push_dtype: auto` resolves from the server's own settings."""

from __future__ import annotations

import json

from slipstream.config import load_config
from slipstream.pipeline import Pipeline
from slipstream.pipeline.modes import prepare_config, served_dtype
from slipstream.serverkinds import vllm as vllm_kind
from tests.pipeline.conftest import pipeline_config


def test_auto_resolves_to_what_each_backend_serves(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    embedded = load_config(None, ["rollout.embedded.dtype=float16"])
    assert served_dtype(embedded) == "float16"
    vllm = load_config(None, [f"model.path={model}", "rollout.backend=vllm"])
    # `auto`, resolved by us and passed to vLLM as --dtype: on its CPU build the faster dtype on this CPU
    assert served_dtype(vllm) == vllm_kind.vllm_dtype(vllm.rollout, str(model))
    command = vllm_kind.vllm_command(str(model), "127.0.0.1", 8000, vllm.rollout)
    assert command[command.index("--dtype") + 1] == served_dtype(vllm)
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


def test_vllm_auto_serves_the_dtype_measured_fastest_on_each_cpu(tmp_path, monkeypatch):
    """vLLM's own `auto` serves every fp32 checkpoint in bf16 on x86, 4.5x slower than fp32 on an AVX2 CPU
    (docs/benchmarks.md, "Served dtype"); ours: bf16 only where the CPU computes it natively, and what vLLM is
    told (--dtype) is what the pushes carry."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    auto = vllm_kind.auto_dtype
    assert auto("float32", cpu=True, bf16=False) == "float32"
    assert auto("bfloat16", cpu=True, bf16=False) == "float32"  # a bf16 checkpoint too: fp32 decodes faster
    assert auto("float32", cpu=True, bf16=True) == "bfloat16"
    assert auto("float32", cpu=False) == "bfloat16" and auto("float16", cpu=False) == "float16"  # vLLM's rule
    for native, expected in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(vllm_kind, "vllm_build", lambda: "cpu")
        monkeypatch.setattr(vllm_kind, "native_bf16", lambda native=native: native)
        cfg = load_config(None, [f"model.path={model}", "rollout.backend=vllm"])
        command = vllm_kind.vllm_command(str(model), "127.0.0.1", 8000, cfg.rollout)
        assert command[command.index("--dtype") + 1] == expected
        assert prepare_config(cfg)[0].weightsync.push_dtype == expected


def test_native_bf16_reads_the_cpu_flags():
    from slipstream.utils.cpu import native_bf16

    avx2 = frozenset({"avx", "avx2", "fma", "f16c"})
    assert not native_bf16(avx2, "x86_64")
    assert native_bf16(avx2 | {"avx512f", "avx512_bf16"}, "x86_64")
    assert native_bf16(avx2 | {"amx_tile", "amx_bf16"}, "x86_64")
    assert native_bf16(frozenset({"fp", "asimd", "bf16"}), "aarch64")
    assert not native_bf16(frozenset({"fp", "asimd"}), "aarch64")
