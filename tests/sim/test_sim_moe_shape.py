"""The profile's MoE shape: a profile names the model its rates are of, and ``scale_to_model`` carries it to
another, per-token rates by active parameters, push bytes by total; ``slipstream simulate --scale-to-model``
runs the Qwen3-30B-A3B recipe on the verl 7B profile carried over."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from helpers_sim import flat_profile

from slipstream.planning.memory import KNOWN
from slipstream.sim import simulate
from slipstream.sim.bench import VERL_PROFILE
from slipstream.sim.profile import ProfileError, load_profile, parse_profile
from slipstream.sim.types import scale_to_model

RECIPE = str(
    Path(__file__).resolve().parents[2] / "configs" / "recipes" / "qwen3-30b-a3b-grpo-math-vllm-fsdp.yaml"
)


def _named(model: dict, **changes):
    """flat_profile's rates, said to be of ``model``."""
    return parse_profile(msgspec.to_builtins(flat_profile(**changes)) | {"model": model})


def test_an_moe_trains_and_decodes_by_its_active_parameters_and_pushes_all_of_them():
    prof = _named({"params": 8e9}, push={"model_bytes": 16e9, "s_per_byte": 1e-9})
    moe = scale_to_model(prof, params=32e9, active_params=2e9)
    assert moe.trainer.tokens_per_s_per_rank == pytest.approx(4 * prof.trainer.tokens_per_s_per_rank)
    assert moe.decode.tokens_per_s == pytest.approx([4 * v for v in prof.decode.tokens_per_s])
    assert moe.prefill_tokens_per_s == pytest.approx(4 * prof.prefill_tokens_per_s)
    assert moe.push.model_bytes == pytest.approx(64e9) and moe.push.seconds > prof.push.seconds
    assert (moe.model.params, moe.model.per_token) == (32e9, 2e9)
    dense = scale_to_model(prof, params=16e9)  # active 0: a dense model, every parameter per token
    assert dense.trainer.tokens_per_s_per_rank == pytest.approx(prof.trainer.tokens_per_s_per_rank / 2)
    assert parse_profile(json.loads(json.dumps(msgspec.to_builtins(moe)))) == moe


def test_a_profile_without_its_model_or_with_more_active_than_total_is_refused_naming_the_field():
    with pytest.raises(ProfileError, match="profile field model: "):
        scale_to_model(flat_profile(), params=1e9)
    with pytest.raises(ProfileError, match="profile field model.active_params"):
        _named({"params": 1e9, "active_params": 2e9})


def test_the_moe_recipe_simulates_on_the_verl_profile_carried_to_its_model(capsys):
    verl = load_profile(VERL_PROFILE)
    shape = KNOWN["Qwen3-30B-A3B"]
    moe = scale_to_model(verl, shape.params, shape.active_params)
    assert moe.trainer.tokens_per_s_per_rank / verl.trainer.tokens_per_s_per_rank == pytest.approx(
        2.27, rel=0.01
    )
    argv = [RECIPE, "--profile", str(VERL_PROFILE), "--steps", "4", "--json"]
    assert simulate.main([*argv, "--scale-to-model"]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert simulate.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert scaled["steps"] == plain["steps"] == 4
    assert scaled["step_s_steady"] < plain["step_s_steady"]  # 3.35B per token trains faster than 7.6B
