"""The `slipstream` command line: help generated from the config descriptions, `--key value` overrides."""

from __future__ import annotations

import json

import pytest

from slipstream import pipeline
from slipstream.cli import main as cli_main
from slipstream.cli_args import add_config_options, command_parser, config_overrides, doc_paragraph
from slipstream.config import Config, load_config
from slipstream.config_doc import sections
from slipstream.rollouter.config import EmbeddedServerConfig
from slipstream.rollouter.serve import build_parser


@pytest.fixture(autouse=True)
def _wide_help(monkeypatch):
    """One line per option help: argparse wraps (and splits hyphenated words) at the terminal width."""
    monkeypatch.setenv("COLUMNS", "4000")


def _description(root, key: str) -> str:
    return next(k.description for s in sections(root) for k in s.keys if k.key == key)


def _option_help(out: str, flag: str) -> str:
    """The help text argparse printed for ``flag`` (beside it, or below when the flag is long)."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip().startswith(flag + " "))
    block = [lines[start]]
    for x in lines[start + 1 :]:
        if not x.strip() or x.lstrip().startswith("-"):
            break
        block.append(x)
    return " ".join(" ".join(block).split())


def test_train_help_explains_a_nested_key(capsys):
    with pytest.raises(SystemExit) as stop:
        pipeline.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    line = _option_help(out, "--trainer.algorithm.clip_c")
    assert _description(Config, "trainer.algorithm.clip_c") in line
    assert "[float | null; default 3.0]" in line
    assert "config keys: trainer.algorithm:" in out  # one group per section, with its docstring
    assert "--check-placement" in out


def test_config_show_help_lists_every_key(capsys):
    assert cli_main(["config", "show", "--help"]) == 0
    out = capsys.readouterr().out
    missing = [k.key for s in sections(Config) for k in s.keys if f"--{k.key} " not in out]
    assert missing == []


def test_serve_help_explains_every_server_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    line = _option_help(out, "--kv-cache-tokens")
    assert _description(EmbeddedServerConfig, "kv_cache_tokens") in line
    assert "[int >= 16; default 32768]" in line


def test_key_flags_are_the_same_overrides_as_positional_ones(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert cli_main(["config", "show", str(tmp_path / "run.yaml"), "trainer.lr=2e-5", "run.resume=true"]) == 0
    positional = capsys.readouterr().out
    flags = ["--trainer.lr", "2e-5", "--run.resume", "true"]
    assert cli_main(["config", "show", str(tmp_path / "run.yaml"), *flags]) == 0
    assert capsys.readouterr().out == positional


def test_key_flags_apply_after_positional_overrides_and_take_yaml_values():
    parser = command_parser("t")
    parser.add_argument("overrides", nargs="*")
    keys = add_config_options(parser, Config)
    ns = parser.parse_intermixed_args(
        ["--trainer.lr", "1e-5", "trainer.lr=9", "--data.train_files", "[a.jsonl, b.jsonl]"]
        + ["--trainer.algorithm.clip_c", "null", "--run.resume", "false", "run.name=x"]
    )
    assert ns.overrides == ["trainer.lr=9", "run.name=x"]  # a bool flag takes its value, never the next word
    cfg = load_config(None, [*ns.overrides, *config_overrides(ns, keys)])
    assert cfg.trainer.lr == 1e-5
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.trainer.algorithm.clip_c is None
    assert (cfg.run.resume, cfg.run.name) == (False, "x")


def test_a_bad_flag_value_names_the_key_and_starts_nothing(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert pipeline.main([str(tmp_path / "run.yaml"), "--trainer.lr", "abc"]) == 2
    assert "trainer.lr: expected float, got str" in capsys.readouterr().err


def test_an_abbreviated_key_flag_is_refused(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert cli_main(["config", "show", str(tmp_path / "run.yaml"), "--trainer.l", "1"]) == 2


def test_config_docs_and_schema(capsys):
    assert cli_main(["config", "docs"]) == 0
    assert "| `trainer.lr` | float > 0 | `1e-06` |" in capsys.readouterr().out
    assert cli_main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    lr = schema["$defs"]["TrainerConfig"]["properties"]["lr"]
    assert lr["description"] == _description(Config, "trainer.lr") and lr["exclusiveMinimum"] == 0


def test_doc_paragraph():
    doc = """First line
    and its tail.

    Second paragraph.
    """
    assert doc_paragraph(doc) == "First line and its tail."
    assert doc_paragraph(doc, 1) == "Second paragraph."
    assert doc_paragraph(None) == ""


def test_a_mistyped_key_flag_gets_a_hint(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert cli_main(["config", "show", str(tmp_path / "run.yaml"), "--trainer.lrr", "1"]) == 2
    assert "unrecognized arguments: --trainer.lrr 1 (did you mean `--trainer.lr`?)" in capsys.readouterr().err


def test_queue_serve_help_explains_every_queue_key(capsys):
    from slipstream.queue.config import QueueConfig
    from slipstream.queue.server import main as queue_serve

    with pytest.raises(SystemExit):
        queue_serve(["--help"])
    out = capsys.readouterr().out
    for row in sections(QueueConfig)[0].keys:
        line = _option_help(out, "--" + row.key.replace("_", "-"))
        assert f"{row.description} [{row.type}; default {row.default}]" in line


def _commands(table=None, prefix=()):
    from slipstream.cli import COMMANDS

    for name, entry in (table or COMMANDS).items():
        if isinstance(entry, dict):
            yield from _commands(entry, (*prefix, name))
        else:
            yield (*prefix, name)


@pytest.mark.parametrize("command", list(_commands()), ids=" ".join)
def test_every_command_has_a_help(command, capsys):
    try:
        code = cli_main([*command, "--help"])
    except SystemExit as stop:
        code = stop.code
    assert code == 0
    assert capsys.readouterr().out.startswith("usage: slipstream " + " ".join(command))
