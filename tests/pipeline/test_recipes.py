"""Every preset in configs/ loads, takes its mode's preset and passes the checks that do not depend on
this machine (cluster recipes name GPU servers and shared paths that do not exist here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_config, prepare_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


def test_the_presets_are_there():
    names = {p.name for p in CONFIGS}
    assert "quickstart.yaml" in names
    assert {
        "qwen2.5-7b-dapo-math-64x64.yaml",
        "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml",
        "qwen2.5-vl-7b-grpo-geometry-vllm-fsdp.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_key_of_every_preset_is_valid(path):
    cfg, _ = prepare_config(load_config(path))
    check_config(cfg, environment=False)


def test_the_cluster_recipes_split_their_gpus_as_documented():
    seven_b = load_config(CONFIGS[0].parent / "recipes" / "qwen2.5-7b-dapo-math-64x64.yaml")
    assert seven_b.rollout.num_servers * seven_b.cluster.gpus_per_server == 64
    assert seven_b.trainer.num_ranks * seven_b.cluster.gpus_per_trainer_rank == 64
    assert (seven_b.rollout.backend, seven_b.trainer.engine) == ("vllm", "fsdp")
    moe = load_config(CONFIGS[0].parent / "recipes" / "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml")
    assert moe.rollout.num_servers * moe.cluster.gpus_per_server == 96
    assert moe.trainer.num_ranks == 32 and (moe.rollout.backend, moe.trainer.engine) == ("sglang", "fsdp")
    vl = load_config(CONFIGS[0].parent / "recipes" / "qwen2.5-vl-7b-grpo-geometry-vllm-fsdp.yaml")
    assert vl.rollout.num_servers * vl.cluster.gpus_per_server == 16
    assert vl.trainer.num_ranks * vl.cluster.gpus_per_trainer_rank == 16


def test_a_recipe_with_a_bad_split_names_the_key():
    path = CONFIGS[0].parent / "recipes" / "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml"
    split = ["trainer.engine=megatron", "trainer.tensor_parallel=4", "trainer.pipeline_parallel=2"]
    cfg, _ = prepare_config(load_config(path, [*split, "trainer.num_ranks=30"]))
    with pytest.raises(ConfigError, match="trainer.num_ranks"):
        check_config(cfg, environment=False)


def test_megatron_with_a_model_it_cannot_convert_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    path = CONFIGS[0].parent / "recipes" / "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml"
    overrides = [f"model.path={tmp_path}", "trainer.engine=megatron", "trainer.tensor_parallel=4"]
    cfg, _ = prepare_config(load_config(path, overrides))
    with pytest.raises(ConfigError, match="trainer.engine: the megatron engine converts .*`qwen3_moe`"):
        check_config(cfg)


def test_the_queue_journal_is_on_exactly_when_the_trainer_may_be_restarted():
    plain, _ = prepare_config(load_config(None))
    assert plain.queue.journal is False
    restarting, notes = prepare_config(load_config(None, ["cluster.restart_trainer=true"]))
    assert restarting.queue.journal is True and any(n.startswith("queue.journal") for n in notes)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_preset_with_validation_files_evaluates_on_them_within_a_small_share_of_the_servers(path):
    cfg = load_config(path)
    if not cfg.data.val_files:
        return
    assert cfg.eval_.every > 0, f"{path.name}: data.val_files is set and eval.every is 0"
    slots = (len(cfg.rollout.server_urls) or cfg.rollout.num_servers) * cfg.rollout.max_concurrent_per_server
    if path.parent.name == "recipes":  # the quickstarts run one server on a laptop
        assert cfg.eval_.max_concurrent <= 0.1 * slots
    assert "does not run yet" not in path.read_text()
