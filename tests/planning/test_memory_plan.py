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

RECIPE = "configs/recipes/qwen2.5-7b-dapo-math-64x64.yaml"


def test_known_shapes_count_the_published_parameters():
    assert KNOWN["Qwen2.5-Math-7B"].params == pytest.approx(7.62e9, rel=0.01)
    assert KNOWN["Qwen3-30B-A3B"].params == pytest.approx(30.5e9, rel=0.01)


def test_a_local_checkpoint_is_read_from_its_config(tmp_path):
    from slipstream.testing import make_tiny_model

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
    # 24,576 tokens x 152,064 vocabulary x 4 bytes x 3 copies
    assert full["logits"] == 3 * 24576 * 152064 * 4
    assert full["logits"] > full["activations"]
    chunked = plan(load_config(RECIPE, [*long, "trainer.logits_chunk_tokens=4096"])).trainer.items
    assert chunked["logits"] * 6 == full["logits"]


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


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_the_estimate_is_within_a_factor_of_two_of_a_measured_step(tmp_path, checkpointing):
    probe = Path(__file__).with_name("memory_probe.py")
    # glibc keeps freed heap memory for reuse, which hides a step's peak from RSS: every allocation above
    # 64 KiB is mapped on its own and returned when freed
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), checkpointing], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["estimated_gib"] * GIB > 64 << 20  # large enough to measure above the noise
    assert 0.5 <= result["measured_gib"] / result["estimated_gib"] <= 2.0, result


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
