"""A trainer rank is built from its own sections plus named values from other roles, each assigned by
``slipstream.config.trainer_settings`` from one root key."""

from __future__ import annotations

import msgspec
import pytest

from slipstream.config import Config, ConfigError, load_config, trainer_settings
from slipstream.trainer.settings import TrainerSettings

# Sections of the root config a trainer rank holds whole; every other section stays out.
OWN_SECTIONS = {"trainer", "model", "run", "weightsync"}

# Each value a trainer rank takes from another role's section (or a single key of its own), and its root key.
FROM_OTHER_ROLES = {
    "sampling_temperature": "rollout.sampling.temperature",
    "sampling_top_k": "rollout.sampling.top_k",
    "sampling_top_p": "rollout.sampling.top_p",
    "loss_scale_tokens": "rollout.sampling.max_new_tokens",
    "max_staleness": "async.max_staleness",
    "stale_policy": "async.stale_policy",
    "sync_every": "async.sync_every",
    "server_kind": "rollout.backend",
    "checkpoint_every": "trainer.checkpoint_every",
}


def _root_value(cfg: Config, key: str):
    value = msgspec.to_builtins(cfg)
    for part in key.split("."):
        value = value[part]
    return value


def test_settings_hold_no_other_roles_section():
    fields = {f.name for f in msgspec.structs.fields(TrainerSettings)}
    sections = {f.name for f in msgspec.structs.fields(Config)}
    assert fields & sections == OWN_SECTIONS
    assert not {"rollout", "async_", "queue", "data", "reward", "agent", "eval_", "cluster"} & fields
    assert fields == OWN_SECTIONS | set(FROM_OTHER_ROLES)


def test_each_value_comes_from_its_root_key():
    cfg = load_config(
        None,
        [
            "rollout.sampling.temperature=0.7",
            "rollout.sampling.top_k=20",
            "rollout.sampling.top_p=0.8",
            "rollout.sampling.max_new_tokens=123",
            "async.max_staleness=3",
            "async.stale_policy=keep",
            "async.sync_every=2",
            "rollout.backend=vllm",
            "trainer.checkpoint_every=5",
            "trainer.lr=2e-5",
            "model.path=/models/x",
        ],
    )
    settings = trainer_settings(cfg)
    for field, key in FROM_OTHER_ROLES.items():
        assert getattr(settings, field) == _root_value(cfg, key), (field, key)
    assert (settings.sampling_temperature, settings.loss_scale_tokens, settings.server_kind) == (
        0.7,
        123,
        "vllm",
    )
    assert settings.trainer.lr == 2e-5 and settings.model.path == "/models/x"
    assert settings.staleness(8, 4) == 2
    for section in OWN_SECTIONS:
        assert getattr(settings, section) is getattr(cfg, section)


def test_settings_travel_as_msgspec():
    settings = trainer_settings(load_config(None, ["async.max_staleness=2"]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(settings), type=TrainerSettings)
    assert back == settings


def test_settings_are_validated_and_a_bad_value_names_its_field():
    cfg = load_config(None, [])
    sampling = msgspec.structs.replace(cfg.rollout.sampling, max_new_tokens=0)
    broken = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, sampling=sampling))
    with pytest.raises(ConfigError, match=r"TrainerSettings\.loss_scale_tokens: Expected `int` >= 1"):
        trainer_settings(broken)
