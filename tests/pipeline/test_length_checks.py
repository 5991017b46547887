"""Prompt + response must fit the episode budget, the servers' context flag and the model's position
limit (read from a local checkpoint, raised by rollout.max_position_embeddings), checked before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_config, position_limit, prepare_config
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverkinds import server_kind
from slipstream.serverkinds import vllm as kind_vllm

RECIPE = Path(__file__).parents[2] / "configs" / "recipes" / "qwen2.5-7b-dapo-math-64x64.yaml"
# The recipe as it was: 20K responses, a 22,528-token context and no position override.
OLD_RECIPE = [
    "rollout.max_position_embeddings=null",
    "rollout.sampling.max_new_tokens=20480",
    "rollout.server_args=[--tensor-parallel-size=4, --max-model-len=22528, --max-num-batched-tokens=22528]",
    "agent.max_total_tokens=22528",
    "reward.overlong_buffer_len=0",
]


@pytest.fixture
def qwen_math_7b(tmp_path) -> str:
    """A checkpoint directory whose config.json says what Qwen2.5-Math-7B's says about positions."""
    config = {"model_type": "qwen2", "max_position_embeddings": 4096, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def checked(path, *overrides: str) -> None:
    cfg, _ = prepare_config(load_config(path, list(overrides)))
    check_config(cfg, environment=False)


def test_the_old_recipe_is_refused_naming_the_override_key(qwen_math_7b):
    with pytest.raises(ConfigError, match=r"rollout.max_position_embeddings: .* supports 4096 positions"):
        checked(RECIPE, f"model.path={qwen_math_7b}", *OLD_RECIPE)


def test_the_recipe_fits_with_its_override_and_passes_it_to_vllm(qwen_math_7b, monkeypatch):
    checked(RECIPE, f"model.path={qwen_math_7b}")
    cfg = load_config(RECIPE)
    assert cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens == 2048 + 28672
    assert cfg.rollout.max_position_embeddings == 32768
    monkeypatch.setattr(kind_vllm, "vllm_build", lambda: "gpu")  # whichever vLLM this machine has
    command = server_kind("vllm").argv("/m", "127.0.0.1", 8000, cfg.rollout)
    flag = command.index("--hf-overrides")
    assert json.loads(command[flag + 1]) == {"max_position_embeddings": 32768}


def test_sglang_gets_the_override_as_model_override_args():
    command = server_kind("sglang").argv(
        "/m", "127.0.0.1", 8000, RolloutConfig(backend="sglang", max_position_embeddings=16384)
    )
    flag = command.index("--json-model-override-args")
    assert json.loads(command[flag + 1]) == {"max_position_embeddings": 16384}
    assert "--json-model-override-args" not in server_kind("sglang").argv("/m", "h", 1, RolloutConfig())


def test_an_episode_budget_below_prompt_plus_response_is_refused():
    with pytest.raises(ConfigError, match="agent.max_total_tokens: 4096 cuts responses .* at least 30720"):
        checked(RECIPE, "agent.max_total_tokens=4096")


def test_a_server_context_below_prompt_plus_response_is_refused():
    with pytest.raises(ConfigError, match="rollout.server_args: --max-model-len=22528 is below .* 30720"):
        checked(RECIPE, "rollout.server_args=[--max-model-len=22528]")
    sglang = RECIPE.parent / "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml"
    with pytest.raises(ConfigError, match="--context-length=10240 is below .* 12288"):
        checked(sglang, "rollout.sampling.max_new_tokens=10240", "agent.max_total_tokens=12288")


def test_an_override_in_the_server_flags_counts_and_may_not_be_doubled(qwen_math_7b):
    overrides = '--hf-overrides={"max_position_embeddings": 32768}'
    checked(
        RECIPE, f"model.path={qwen_math_7b}", "rollout.max_position_embeddings=null",
        f"rollout.server_args=['--max-model-len=30720', '{overrides}']",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="rollout.max_position_embeddings: rollout.server_args also pass"):
        checked(RECIPE, f"rollout.server_args=['{overrides}']")


def test_other_length_rules():
    with pytest.raises(ConfigError, match="rollout.max_position_embeddings: only launched vllm/sglang"):
        checked(None, "rollout.max_position_embeddings=8192")
    with pytest.raises(ConfigError, match="reward.overlong_buffer_len: 300 is longer"):
        checked(None, "reward.overlong_buffer_len=300")


def test_position_limit_follows_the_checkpoint(tmp_path):
    assert position_limit(str(tmp_path / "missing")) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert position_limit(str(tmp_path)) == 4096 and position_limit(str(tmp_path), 32768) == 32768
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(linear))
    assert position_limit(str(tmp_path)) == 16384
    yarn = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(yarn))
    assert position_limit(str(tmp_path)) == 131072  # YaRN configs give the stretched length
    both = {"max_position_embeddings": 8192, "seq_length": 4096}
    (tmp_path / "config.json").write_text(json.dumps(both))
    assert position_limit(str(tmp_path)) == 4096
