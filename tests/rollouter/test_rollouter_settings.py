"""The rollouter is built from its own sections plus named values from other roles, each assigned by
``slipstream.config.rollouter_settings`` from one root key."""

from __future__ import annotations

import msgspec
import pytest

from slipstream.config import Config, ConfigError, load_config, rollouter_settings
from slipstream.rollouter.settings import RollouterSettings

# Sections of the root config the rollouter holds whole; every other section stays out.
OWN_SECTIONS = {"rollout", "data", "agent", "reward", "eval_", "model"}

# Each value the rollouter takes from another role's section, and the root key it comes from.
FROM_OTHER_ROLES = {
    "seed": "run.seed",
    "mode": "async.mode",
    "staleness_threshold": "async.staleness_threshold",
    "sync_every": "async.sync_every",
    "stale_policy": "async.stale_policy",
    "max_stale_drops": "async.max_stale_drops",
    "batch_groups": "trainer.batch_groups",
    "put_timeout_s": "queue.put_timeout_s",
    "restart_servers": "cluster.restart_servers",
    "health_interval_s": "cluster.health_interval_s",
}
# Values derived from another role's key: trainer.moe.routing_replay == "rollout" (test_routing_replay_check.py).
DERIVED = {"return_routes"}


def _root_value(cfg: Config, key: str):
    value = msgspec.to_builtins(cfg)
    for part in key.split("."):
        value = value[part]
    return value


def test_settings_hold_no_other_roles_section():
    fields = {f.name for f in msgspec.structs.fields(RollouterSettings)}
    sections = {f.name for f in msgspec.structs.fields(Config)}
    assert fields & sections == OWN_SECTIONS
    assert not {"trainer", "async_", "queue", "weightsync", "cluster", "run", "wandb"} & fields
    assert fields == OWN_SECTIONS | set(FROM_OTHER_ROLES) | DERIVED


def test_each_value_comes_from_its_root_key():
    cfg = load_config(
        None,
        [
            "run.seed=7",
            "async.mode=fully_async",  # no preset: each value as written (presets: test_gate.py)
            "async.staleness_threshold=1.5",
            "async.sync_every=3",
            "async.stale_policy=keep",
            "async.max_stale_drops=5",
            "trainer.batch_groups=9",
            "queue.put_timeout_s=12",
            "cluster.restart_servers=false",
            "cluster.health_interval_s=2",
            "rollout.n=3",
            "eval.every=4",
        ],
    )
    settings = rollouter_settings(cfg)
    for field, key in FROM_OTHER_ROLES.items():
        assert getattr(settings, field) == _root_value(cfg, key), (field, key)
    assert (settings.batch_groups, settings.put_timeout_s, settings.seed) == (9, 12.0, 7)
    assert settings.rollout.n == 3 and settings.eval_.every == 4
    for section in OWN_SECTIONS:
        assert getattr(settings, section) is getattr(cfg, section)


def test_settings_travel_as_msgspec():
    settings = rollouter_settings(load_config(None, ["trainer.batch_groups=3"]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(settings), type=RollouterSettings)
    assert back == settings


def test_settings_are_validated_and_a_bad_value_names_its_field():
    cfg = load_config(None, [])
    # msgspec.structs.replace checks nothing: only the settings' own validation can catch this.
    broken = msgspec.structs.replace(cfg, queue=msgspec.structs.replace(cfg.queue, put_timeout_s=0.0))
    with pytest.raises(ConfigError, match=r"RollouterSettings\.put_timeout_s: Expected `float` > 0"):
        rollouter_settings(broken)
