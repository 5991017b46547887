"""Commands whose options are config fields get them generated from the config: every field is an option,
its help the field's description, its value checked against the field's type and bounds (a bad one is
refused naming the key), and a field added to the struct is an option without touching the parser."""

from __future__ import annotations

import argparse
from typing import Annotated, Any

import msgspec
import pytest
from msgspec import Meta
from msgspec import inspect as mi

from slipstream.cli_args import add_key_option, command_parser, config_values, field_type, key_doc
from slipstream.config import Config, from_dict
from slipstream.config_doc import sections, value_type
from slipstream.queue import server as queue_server
from slipstream.queue.config import QueueConfig
from slipstream.rollouter import serve
from slipstream.rollouter.config import EmbeddedServerConfig


def _generated(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of ``parser`` made from a config key, by flag."""
    return {a.option_strings[0]: a for a in parser._actions if hasattr(a, "config_key")}


def _keys(root: type[msgspec.Struct]) -> set[str]:
    return {row.key for section in sections(root) for row in section.keys}


def _bad_value(root: type[msgspec.Struct], key: str) -> str | None:
    """A value the key refuses: just past a bound, outside its choices, or not of its type."""
    info = value_type(key_doc(root, key).info)
    if isinstance(info, (mi.IntType, mi.FloatType)):
        step = 1 if isinstance(info, mi.IntType) else 0.5
        for bound, value in (
            (info.ge, lambda b: b - step),
            (info.gt, lambda b: b),
            (info.le, lambda b: b + step),
        ):
            if bound is not None:
                return str(value(bound))
        return "abc"
    if isinstance(info, mi.LiteralType):
        return "not-a-choice"
    if isinstance(info, mi.BoolType):
        return "maybe"
    return None  # any text is a valid str


def _queue_parser() -> argparse.ArgumentParser:
    return queue_server.build_parser()[0]


# command, its parser, the config its generated options come from, how their keys are written there
STRUCT_COMMANDS = [
    ("slipstream queue serve", _queue_parser, QueueConfig),
    ("slipstream serve", serve.build_parser, EmbeddedServerConfig),
]


def _bench_parsers() -> list[tuple[str, Any]]:
    from slipstream.system import bench_logprob, bench_served_dtype, bench_train, bench_weightsync, e2e, scale
    from slipstream.system import bench_rollout as rollout_bench
    from slipstream.system import bench_transport as weightsync_bench

    return [
        ("bench weightsync", weightsync_bench.build_parser),
        ("bench rollout", rollout_bench.build_parser),
        ("bench train", bench_train._parser),
        ("bench logprob", bench_logprob._parser),
        ("bench e2e", e2e._parser),
        ("bench weightsync --target vllm", bench_weightsync._parser),
        ("bench served-dtype", bench_served_dtype._parser),
        ("bench scale", scale._parser),
    ]


# the keys each bench borrows: a bench that drops one, or names one that is not a key, fails here
BENCH_KEYS = {
    "bench weightsync": {"weightsync.bucket_mb", "weightsync.timeout_s"},
    "bench rollout": {"rollout.sampling.max_new_tokens", "rollout.embedded.dtype", "rollout.backend"},
    "bench train": {"trainer.micro_batch_tokens", "rollout.n"},
    "bench logprob": {"trainer.logits_chunk_tokens"},
    "bench e2e": {
        "trainer.batch_groups",
        "rollout.n",
        "rollout.sampling.max_new_tokens",
        "async.staleness_threshold",
        "async.max_staleness",
        "rollout.backend",
    },
    "bench weightsync --target vllm": {
        "weightsync.bucket_mb",
        "weightsync.timeout_s",
        "weightsync.pause_mode",
    },
    "bench served-dtype": {"rollout.sampling.max_new_tokens", "rollout.vllm.cpu_threads"},
    "bench scale": {
        "rollout.sampling.max_new_tokens",
        "rollout.max_concurrent_per_server",
        "async.partial_rollout",
    },
}


@pytest.mark.parametrize(("name", "build", "root"), STRUCT_COMMANDS, ids=[c[0] for c in STRUCT_COMMANDS])
def test_every_field_is_an_option_described_by_the_field(name, build, root):
    options = _generated(build())
    assert {a.config_key for a in options.values()} == _keys(root)
    for flag, action in options.items():
        row = key_doc(root, action.config_key)
        assert flag == "--" + row.key.replace("_", "-")
        assert action.help == f"{row.description} [{row.type}; default {row.default}]".replace("%", "%%")


@pytest.mark.parametrize(("name", "build", "root"), STRUCT_COMMANDS, ids=[c[0] for c in STRUCT_COMMANDS])
def test_a_bad_value_is_refused_naming_the_key(name, build, root, capsys):
    checked = 0
    for flag, action in _generated(build()).items():
        bad = _bad_value(root, action.config_key)
        if bad is None:
            continue
        with pytest.raises(SystemExit) as stop:
            build().parse_args(["--model", "m", flag, bad] if root is EmbeddedServerConfig else [flag, bad])
        assert stop.value.code == 2
        assert f"argument {flag}: {action.config_key}: expected" in capsys.readouterr().err
        checked += 1
    assert checked >= 5


def test_a_field_added_to_the_queue_config_is_an_option_without_touching_the_parser(monkeypatch):
    class Grown(QueueConfig):
        """The queue config with one more field."""

        spill_after_s: Annotated[float, Meta(gt=0, description="A field added later.")] = 5.0

    monkeypatch.setattr(queue_server, "QueueConfig", Grown)
    parser, keys = queue_server.build_parser()
    action = _generated(parser)["--spill-after-s"]
    assert action.help == "A field added later. [float > 0; default 5.0]"
    ns = parser.parse_intermixed_args(["--spill-after-s", "2.5", "capacity_groups=7"])
    assert from_dict(config_values(ns, keys), Grown).spill_after_s == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--spill-after-s", "0"])


def test_a_field_added_to_the_server_config_is_an_option_without_touching_the_parser(monkeypatch):
    class Grown(EmbeddedServerConfig):
        """The server config with one more field."""

        prefill_chunk: Annotated[int, Meta(ge=1, description="A field added later.")] = 512

    monkeypatch.setattr(serve, "EmbeddedServerConfig", Grown)
    parser = serve.build_parser()
    assert _generated(parser)["--prefill-chunk"].help == "A field added later. [int >= 1; default 512]"
    assert (
        serve.parse_config(parser.parse_args(["--model", "m", "--prefill-chunk", "64"])).prefill_chunk == 64
    )


def test_queue_serve_flags_rebuild_the_config_and_win_over_overrides():
    cfg = QueueConfig(
        num_storage_units=3, capacity_groups=17, journal=True, shared_memory=False, journal_dir=""
    )
    parser, keys = queue_server.build_parser()
    ns = parser.parse_intermixed_args(queue_server.config_args(cfg))
    assert from_dict(config_values(ns, keys), QueueConfig) == cfg
    ns = parser.parse_intermixed_args(
        ["capacity_groups=5", "--capacity-groups", "7", "--journal", "queue.ipc=false"]
    )
    assert (ns.overrides, config_values(ns, keys)) == (
        ["capacity_groups=5", "queue.ipc=false"],
        {"capacity_groups": 7, "journal": True},
    )


def test_queue_serve_refuses_a_bad_override_naming_the_key(capsys):
    assert queue_server.main(["capacity_groups=0"]) == 2
    assert "capacity_groups: expected int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BENCH_KEYS))
def test_a_bench_takes_the_config_keys_it_borrows_from_the_config(name, capsys):
    build = dict(_bench_parsers())[name]
    options = _generated(build())
    assert {a.config_key for a in options.values()} == BENCH_KEYS[name]
    defaults = vars(build().parse_args([]))
    for flag, action in options.items():
        row = key_doc(Config, action.config_key)
        assert action.help.startswith(f"{row.description} [{row.key}: {row.type}; default ")
        bad = _bad_value(Config, action.config_key)
        with pytest.raises(SystemExit) as stop:
            build().parse_args([flag, bad])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {row.key}: expected" in err or f"argument {flag}: invalid choice" in err
        msgspec.convert(
            defaults[action.dest], field_type(Config, row.key)
        )  # the bench's default is a valid value


def test_a_bench_default_is_its_own_and_the_help_shows_the_configs():
    from slipstream.system import bench_transport as bench

    parser = bench.build_parser()
    assert parser.parse_args([]).bucket_mb == 64
    assert parser.parse_args(["--bucket-mb", "32"]).bucket_mb == 32
    action = _generated(parser)["--bucket-mb"]
    assert "default 64 here; 256 in a run's config" in action.help


def test_narrowed_choices_must_be_values_of_the_key():
    from slipstream.rollouter.config import RolloutConfig

    with pytest.raises(ValueError, match="backend: choices \\['tgi'\\] are not values"):
        add_key_option(command_parser("t"), RolloutConfig, "backend", choices=["embedded", "tgi"])


def test_data_make_takes_datagen_keys(tmp_path, capsys):
    from slipstream.agents.datagen import main as datagen_main

    with pytest.raises(SystemExit):
        datagen_main(["arithmetic", "--n", "0", "--out", str(tmp_path / "a.jsonl")])
    assert "argument --n: datagen.n: expected int >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        datagen_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert key_doc(Config, "datagen.seed").description in help_text
