"""The Qwen3-30B-A3B recipe on vLLM and FSDP2 (separate clusters): it plans on 80 GB GPUs with the MoE's
counts, passes every check `slipstream train` makes (a local checkpoint of the model's config.json in place
of the cluster's path), and refuses routing replay on vLLM naming the key and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_config, prepare_config
from slipstream.planning.memory import main as plan_main

RECIPE = (
    Path(__file__).resolve().parents[2] / "configs" / "recipes" / "qwen3-30b-a3b-grpo-math-vllm-fsdp.yaml"
)
# Qwen3-30B-A3B's config.json, the keys the checks and the planner read
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path


def test_the_recipe_splits_vllm_and_fsdp_over_separate_clusters():
    cfg = load_config(str(RECIPE))
    assert (cfg.rollout.backend, cfg.trainer.engine, cfg.cluster.colocate) == ("vllm", "fsdp", False)
    assert cfg.rollout.num_servers * cfg.cluster.gpus_per_server == 96 and cfg.trainer.num_ranks == 32


def test_the_recipe_plans_with_its_total_and_active_parameters(capsys, checkpoint):
    assert plan_main([str(RECIPE), "--json"]) == 0
    known = json.loads(capsys.readouterr().out)
    assert known["fits"] and known["params"] == pytest.approx(30.5e9, rel=0.01)
    assert known["active_params"] == pytest.approx(3.3e9, rel=0.03)
    assert known["trainer_gpu"]["items_gib"]["sharded experts: parameters, AdamW moments"] > 10
    assert plan_main([str(RECIPE), f"model.path={checkpoint}", "--json"]) == 0  # from the checkpoint's file
    local = json.loads(capsys.readouterr().out)
    assert (local["params"], local["active_params"]) == (known["params"], known["active_params"])


def test_the_recipe_passes_config_check_and_refuses_replay_on_vllm_naming_the_key(checkpoint):
    cfg, _ = prepare_config(load_config(str(RECIPE), [f"model.path={checkpoint}"]))
    check_config(cfg)
    replay, _ = prepare_config(
        load_config(str(RECIPE), [f"model.path={checkpoint}", "trainer.moe.routing_replay=rollout"])
    )
    with pytest.raises(ConfigError, match=r"trainer.moe.routing_replay: .*Model Runner V2"):
        check_config(replay)
