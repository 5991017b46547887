"""``trainer.moe.routing_replay: rollout`` is refused at config check where it cannot work: a server kind that
returns no routes (naming why), a dense model, a Megatron engine; and it turns the rollouter's route requests
on."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, load_config, rollouter_settings
from slipstream.pipeline.modes import _check_routing_replay, prepare_config
from slipstream.utils.tiny_models import MOE_FAMILIES

REPLAY = "trainer.moe.routing_replay=rollout"


def _cfg(*overrides: str):
    return prepare_config(load_config(None, list(overrides)))[0]


@pytest.mark.parametrize(
    ("backend", "reason"), [("vllm", "Model Runner V2 and Triton"), ("sglang", "not wired")]
)
def test_servers_without_routes_are_refused_naming_the_key_and_why(backend, reason, tiny_moe_models):
    path = tiny_moe_models["qwen3_moe"]
    cfg = _cfg(REPLAY, f"rollout.backend={backend}", "cluster.gpus_per_server=1", f"model.path={path}")
    with pytest.raises(ConfigError, match=rf"trainer.moe.routing_replay: .*{reason}"):
        _check_routing_replay(cfg)


def test_a_dense_model_is_refused_and_an_moe_model_on_the_embedded_server_passes(
    tiny_model_path, tiny_moe_models
):
    with pytest.raises(ConfigError, match=r"trainer.moe.routing_replay: .* model.path is a dense model"):
        _check_routing_replay(_cfg(REPLAY, f"model.path={tiny_model_path}"))
    for path in (tiny_moe_models[f] for f in MOE_FAMILIES):
        cfg = _cfg(REPLAY, f"model.path={path}")
        _check_routing_replay(cfg)
        assert rollouter_settings(cfg).return_routes
    assert not rollouter_settings(_cfg(f"model.path={tiny_model_path}")).return_routes


def test_megatron_is_refused():
    with pytest.raises(
        (ConfigError, ValueError),
        match=r"moe.routing_replay .?rollout.? is supported with engine .?fsdp.? only",
    ):
        _cfg(REPLAY, "trainer.engine=megatron")
