"""A trainer rank is built from its own sections plus named values from other roles, each mapped by
``from_root`` from the root key ``ROOT_KEYS`` documents."""

from __future__ import annotations

import msgspec

from slipstream.config import Config, load_config
from slipstream.trainer.settings import ROOT_KEYS, TrainerSettings, from_root

# Sections of the root config a trainer rank holds whole; every other section stays out.
OWN_SECTIONS = {"trainer", "model", "run", "weightsync"}


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
    assert fields == OWN_SECTIONS | set(ROOT_KEYS)


def test_from_root_maps_each_value_from_its_documented_key():
    cfg = load_config(
        None,
        [
            "rollout.sampling.temperature=0.7",
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
    settings = from_root(cfg)
    for field, key in ROOT_KEYS.items():
        assert getattr(settings, field) == _root_value(cfg, key), (field, key)
    assert (settings.sampling_temperature, settings.loss_scale_tokens, settings.server_kind) == (
        0.7,
        123,
        "vllm",
    )
    assert settings.trainer.lr == 2e-5 and settings.model.path == "/models/x"
    assert settings.staleness(8, 4) == 2


def test_settings_travel_as_msgspec():
    settings = from_root(load_config(None, ["async.max_staleness=2"]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(settings), type=TrainerSettings)
    assert back == settings
