"""The Qwen2.5-VL-7B recipe on vLLM and FSDP2 (separate clusters, Geometry3K): it plans on 80 GB GPUs with the
vision tower counted, from the planner's table and from the checkpoint's own files alike, passes every check
`slipstream train` makes (a local copy of the model's config files in place of the cluster's path) with the
tower trained or frozen, a trainer GPU the tower's activations overflow fails naming the keys, and the
capacity plan (`slipstream plan`) searches its split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.cli import config_check
from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_config, prepare_config
from slipstream.planning.memory import main as plan_main

RECIPE = (
    Path(__file__).resolve().parents[2] / "configs" / "recipes" / "qwen2.5-vl-7b-grpo-geometry-vllm-fsdp.yaml"
)
# Qwen2.5-VL-7B-Instruct's config.json as published (the language model's keys at the top), the keys the
# checks and the planner read, and its preprocessor_config.json's resize bounds
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 128000, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "image_token_id": 151655, "video_token_id": 151656, "torch_dtype": "bfloat16",
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "temporal_patch_size": 2},
}  # fmt: skip
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor"}  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return tmp_path


def test_the_recipe_splits_vllm_and_fsdp_over_separate_clusters():
    cfg = load_config(str(RECIPE))
    assert (cfg.rollout.backend, cfg.trainer.engine, cfg.cluster.colocate) == ("vllm", "fsdp", False)
    assert cfg.rollout.num_servers * cfg.cluster.gpus_per_server == 16 and cfg.trainer.num_ranks == 16
    assert (cfg.rollout.vllm.route, cfg.agent.name) == ("generate", "single_turn")  # images reach vLLM


def test_the_recipe_plans_with_the_vision_tower_from_the_table_and_the_checkpoint(capsys, checkpoint):
    assert plan_main([str(RECIPE), "--json"]) == 0
    known = json.loads(capsys.readouterr().out)
    assert known["fits"] and known["params"] == pytest.approx(8.29e9, rel=0.01)
    assert known["vision"]["params"] == pytest.approx(0.68e9, rel=0.01)
    assert known["trainer_gpu"]["items_gib"]["vision tower activations"] > 0
    assert plan_main([str(RECIPE), f"model.path={checkpoint}", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in local.items() if k != "model"} == {
        k: v for k, v in known.items() if k != "model"
    }


@pytest.mark.parametrize("frozen", ["false", "true"])
def test_the_recipe_passes_config_check_with_the_tower_trained_or_frozen(capsys, checkpoint, frozen):
    overrides = [f"model.path={checkpoint}", f"trainer.freeze_vision_tower={frozen}"]
    cfg, _ = prepare_config(load_config(str(RECIPE), overrides))
    check_config(cfg)
    assert config_check([str(RECIPE), *overrides]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")


def test_a_trainer_gpu_the_tower_does_not_fit_names_the_keys(checkpoint):
    overrides = [
        f"model.path={checkpoint}",
        "trainer.activation_checkpointing=false",
        "cluster.gpu_memory_gib=80",
    ]
    cfg, _ = prepare_config(load_config(str(RECIPE), overrides))
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing.*largest item: vision tower"):
        check_config(cfg)


def test_the_recipe_runs_through_the_capacity_plan(capsys):
    """`slipstream plan` (capacity) searches splits of the recipe's 32 GPUs on the verl 7B profile."""
    from slipstream.sim.bench import VERL_PROFILE
    from slipstream.sim.plan import main as capacity_main

    argv = [str(RECIPE), "--profile", str(VERL_PROFILE), "--gpus", "32", "--steps", "4", "--thresholds", "0.5",
            "--sync-every", "4", "--concurrency", "1", "--refine", "1", "--json"]  # fmt: skip
    assert capacity_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    assert best["rollout_gpus"] + best["trainer_gpus"] == 32 and best["rollout_gpus"] % 2 == 0
