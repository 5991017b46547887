"""`slipstream plan memory`: shapes, the shipped recipes' plans, refusals naming the key, and the estimate
against a measured training step on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config import load_config
from slipstream.planning.memory import GIB, KNOWN, main, model_shape, plan
from tests.planning.saved_activations import saved_bytes

RECIPE = "configs/recipes/qwen2.5-7b-dapo-math-64x64.yaml"


def test_known_shapes_count_the_published_parameters():
    assert KNOWN["Qwen2.5-Math-7B"].params == pytest.approx(7.62e9, rel=0.01)
    assert KNOWN["Qwen3-30B-A3B"].params == pytest.approx(30.5e9, rel=0.01)


def test_a_local_checkpoint_is_read_from_its_config(tmp_path):
    from slipstream.utils.tiny_models import make_tiny_model

    shape = model_shape(str(make_tiny_model(tmp_path / "m", hidden_size=64, num_layers=3)))
    assert (shape.hidden, shape.layers) == (64, 3)
    with pytest.raises(ValueError, match="model.path"):
        model_shape(str(tmp_path / "nowhere" / "Mystery-9B"))


def test_full_vocabulary_logits_dominate_a_long_micro_batch_and_chunks_remove_them():
    long = [
        "trainer.micro_batch_tokens=24576",
        "trainer.sequence_parallel_size=1",
        "trainer.activation_checkpointing=true",
    ]
    full = plan(load_config(RECIPE, [*long, "trainer.logits_chunk_tokens=0"])).trainer.items
    # 24,576 tokens x 152,064 vocabulary x (fp32 logits, fp32 softmax, bf16 matmul output), the scored
    # hidden states (bf16) and the output weight's fp32 gradient accumulator
    fixed = 24576 * 3584 * 2 + 152064 * 3584 * 4
    assert full["logits"] == 24576 * 152064 * 10 + fixed
    assert full["logits"] > full["activations"]
    chunked = plan(load_config(RECIPE, [*long, "trainer.logits_chunk_tokens=4096"])).trainer.items
    assert (chunked["logits"] - fixed) * 6 == full["logits"] - fixed


def test_the_root_module_fsdp_keeps_unsharded_is_planned():
    """FSDP2 keeps the root module (embeddings and output layer, 2 x 152,064 x 3,584 parameters on the 7B
    recipe) unsharded through forward and backward, with bf16 gradients and their fp32 reduce copies."""
    items = plan(load_config(RECIPE, [])).trainer.items
    root = 2 * 152064 * 3584 + 3584
    assert items["unsharded root module (embeddings, output layer)"] == root * 2
    assert items["root module gradients"] == root * (2 + 4)


def _saved_bytes_per_layer(dtype, layers: int, tokens: int = 256) -> int:
    """Bytes of the distinct tensors autograd saves in a forward of a plain HF Llama (parameters aside)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, 64, (1, tokens))
    return saved_bytes(model, lambda: model.model(input_ids=ids).last_hidden_state.sum())


@pytest.mark.parametrize("dtype_name, compute", [("float32", 4), ("bfloat16", 2)])
def test_activation_bytes_per_layer_are_what_autograd_saves(dtype_name, compute):
    import torch

    from slipstream.planning.memory import shape_from_hf

    dtype = getattr(torch, dtype_name)
    measured = (_saved_bytes_per_layer(dtype, 3) - _saved_bytes_per_layer(dtype, 1)) / 2 / 256
    shape = shape_from_hf({"hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 64})  # fmt: skip
    assert measured == pytest.approx(shape.activation_bytes_per_token_layer(compute), rel=0.03)


def test_the_shipped_recipes_fit_80gb_gpus(capsys):
    for recipe in sorted(Path("configs/recipes").glob("*.yaml")):
        if model_shape_known(recipe):
            assert main([str(recipe), "--json"]) == 0, capsys.readouterr().out
            assert json.loads(capsys.readouterr().out)["fits"]


def model_shape_known(recipe: Path) -> bool:
    return Path(load_config(str(recipe), []).model.path).name in KNOWN


def test_a_response_longer_than_the_models_positions_is_refused_naming_the_keys(capsys):
    assert main([RECIPE, "rollout.max_position_embeddings=null", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["positions_needed"] > out["max_positions"] == 4096
    assert "rollout.max_position_embeddings" in out["problems"][0]


def test_a_trainer_that_cannot_fit_names_the_keys_to_change(capsys):
    no_sp = ["trainer.micro_batch_tokens=24576", "trainer.sequence_parallel_size=1"]
    assert main([RECIPE, *no_sp, "trainer.logits_chunk_tokens=0", "--gpu-mem", "40"]) == 1
    out = capsys.readouterr().out
    assert "trainer.micro_batch_tokens" in out and "largest item: logits" in out


@pytest.mark.parametrize("checkpointing, vocab", [("false", 0), ("true", 0), ("true", 50000)])
def test_the_estimate_is_within_20_percent_of_a_measured_step(tmp_path, checkpointing, vocab):
    """Everything a step allocates and frees, planned against a real CPU step's peak: activations (with and
    without checkpointing) on a narrow-vocabulary model; the root module, its gradients and the chunked
    logprob head on a 50,000-token vocabulary where they dominate."""
    probe = Path(__file__).with_name("memory_probe.py")
    # glibc keeps freed heap memory for reuse, which hides a step's peak from RSS: every allocation above
    # 64 KiB is mapped on its own and returned when freed
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), checkpointing, str(vocab)],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["estimated_gib"] * GIB > 64 << 20  # large enough to measure above the noise
    assert 1 / 1.2 <= result["measured_gib"] / result["estimated_gib"] <= 1.2, result


def test_the_config_check_refuses_a_gpu_run_that_cannot_fit_before_anything_launches():
    from slipstream.config import ConfigError
    from slipstream.pipeline.modes import check_config, prepare_config

    def check(*overrides):
        cfg, _ = prepare_config(load_config(RECIPE, list(overrides)))
        check_config(cfg, environment=False)

    check()  # the recipe fits 80 GB GPUs
    no_sp = ["trainer.micro_batch_tokens=24576", "trainer.sequence_parallel_size=1"]
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens.*cluster.gpu_memory_gib = 40"):
        check(*no_sp, "trainer.logits_chunk_tokens=0", "cluster.gpu_memory_gib=40")


def test_a_colocated_trainer_and_server_are_planned_against_one_gpu_together(capsys):
    """With cluster.colocate a rank and a server share a GPU: each alone fits 80 GiB, together they must."""
    embedded = [RECIPE, "cluster.colocate=true", "rollout.backend=embedded", "rollout.embedded.device=cuda",
                "rollout.embedded.dtype=bfloat16"]  # fmt: skip
    small = plan(load_config(RECIPE, [*embedded[1:], "rollout.embedded.kv_cache_tokens=32768"]))
    assert small.trainer.total + small.inference.total <= 80 * GIB and not small.problems
    assert small.trainer.limit == 80 * GIB - small.inference.total
    big = [*embedded, "rollout.embedded.kv_cache_tokens=1048576"]
    alone = plan(load_config(RECIPE, [*big[1:], "cluster.colocate=false"]))
    assert alone.trainer.fits and alone.inference.fits  # each would fit a GPU of its own
    assert main([*big, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert "sharing the GPU" in out["problems"][0] and "trainer.micro_batch_tokens" in out["problems"][0]
    # vLLM takes --gpu-memory-utilization (0.8 in the recipe) of the GPU: the trainer gets the rest
    vllm = plan(load_config(RECIPE, ["cluster.colocate=true"]))
    assert vllm.trainer.limit == 80 * GIB - int(80 * GIB * 0.8) and not vllm.trainer.fits
