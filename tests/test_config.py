from typing import Annotated

import msgspec
import pytest

from slipstream.cli import main as cli_main
from slipstream.config import Config, ConfigError, from_dict, load_config, to_yaml
from slipstream.config_base import ALLOW_INF, ConfigStruct


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.queue.host == "127.0.0.1"
    assert cfg.async_.mode == "fully_async"


def test_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "trainer.lr=2e-5",
            "async.mode=sync",
            "data.train_files=[a.jsonl, b.jsonl]",
            "trainer.algorithm.clip_c=null",
            "rollout.sampling.top_k=20",
        ],
    )
    assert cfg.trainer.lr == pytest.approx(2e-5)
    assert cfg.async_.mode == "sync"
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.trainer.algorithm.clip_c is None
    assert cfg.rollout.sampling.top_k == 20


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.lrr=1", "trainer.lrr: unknown key; did you mean `lr`?"),
        ("trainer.lr=abc", "trainer.lr: expected float, got str"),
        ("trainer.lr=-1", "trainer.lr: expected float > 0.0"),
        ("async.mode=fast", "async.mode: 'fast' is not one of 'sync', 'one_step_off', 'fully_async'"),
        ("asyncc.mode=sync", "asyncc: unknown key; did you mean `async`?"),
        ("queue.port=70000", "queue.port: expected int <= 65535"),
        ("no_equals_sign", "expected dotted.key=value"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.lr=inf", "trainer.lr: expected a finite number, got inf"),
        ("queue.lease_timeout_s=inf", "queue.lease_timeout_s: expected a finite number, got inf"),
        ("trainer.algorithm.clip_c=nan", "trainer.algorithm.clip_c: expected a finite number, got nan"),
        ("trainer.algorithm.clip_c=inf", "trainer.algorithm.clip_c: expected a finite number, got inf"),
        ("trainer.betas=[-inf, 0.999]", "trainer.betas[0]: expected a finite number, got -inf"),
        ("trainer.betas=[0.9, inf]", "trainer.betas[1]: expected a finite number, got inf"),
    ],
)
def test_infinite_and_nan_floats_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == needle


def test_infinite_float_in_a_preset_names_the_key(tmp_path):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=r"^trainer\.lr: expected a finite number, got inf$"):
        load_config(tmp_path / "run.yaml")


class _Deadline(ConfigStruct):
    # Seconds to wait; inf waits forever.
    wait_s: Annotated[float, msgspec.Meta(extra={ALLOW_INF: True})] = 1.0
    poll_s: float = 1.0


def test_a_field_may_opt_in_to_infinity_but_never_to_nan():
    assert from_dict({"wait_s": "inf"}, _Deadline).wait_s == float("inf")
    with pytest.raises(ConfigError, match="^poll_s: expected a finite number"):
        from_dict({"poll_s": "inf"}, _Deadline)
    with pytest.raises(ConfigError, match="^wait_s: expected a finite number, got nan"):
        from_dict({"wait_s": "nan"}, _Deadline)


def test_yaml_base_and_roundtrip(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  lr: 1.0e-5\n  batch_groups: 4\n")
    (tmp_path / "run.yaml").write_text(
        "base: base.yaml\ntrainer:\n  batch_groups: 6\nasync:\n  sync_every: 2\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.trainer.lr, cfg.trainer.batch_groups, cfg.async_.sync_every) == (1e-5, 6, 2)
    (tmp_path / "again.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "again.yaml") == cfg


def test_bad_yaml_files(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "cycle.yaml").write_text("base: cycle.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "cycle.yaml")


def test_a_key_set_twice_in_a_preset_names_the_file_the_key_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  lr: 1.0e-5\n  batch_groups: 4\n  lr: 2.0e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: `trainer.lr` is set twice, at lines 2 and 4; keep one"
    path.write_text("trainer:\n  lr: 1.0e-5\nqueue:\n  port: 5555\ntrainer:\n  batch_groups: 4\n")
    with pytest.raises(ConfigError, match=r"`trainer` is set twice, at lines 1 and 5"):
        load_config(path)


def test_a_base_preset_with_a_repeated_key_is_named(tmp_path):
    (tmp_path / "base.yaml").write_text("async:\n  mode: sync\n  mode: fully_async\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: `async\.mode` is set twice, at lines 2 and 3"):
        load_config(tmp_path / "run.yaml")


def test_the_same_key_in_different_sections_is_fine(tmp_path):
    (tmp_path / "ok.yaml").write_text("queue:\n  host: 127.0.0.1\nrollout:\n  sampling:\n    top_k: 5\n")
    assert load_config(tmp_path / "ok.yaml").rollout.sampling.top_k == 5


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_an_empty_preset_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: the file is empty"):
        load_config(path)


def test_a_preset_that_only_names_its_base_is_fine(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\n")
    assert load_config(tmp_path / "run.yaml").trainer.lr == 3e-6


def test_cli_config_show(tmp_path, capsys):
    assert cli_main(["config", "show", str(tmp_path / "nope.yaml")]) == 2
    (tmp_path / "ok.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert cli_main(["config", "show", str(tmp_path / "ok.yaml"), "async.sync_every=3"]) == 0
    out = capsys.readouterr().out
    assert "lr: 3.0e-06" in out and "sync_every: 3" in out
    assert cli_main(["nosuch"]) == 2


def test_null_override_clears_an_optional_value_and_is_refused_where_a_value_is_needed():
    cfg = load_config(None, ["cluster.ray_address=auto", "cluster.ray_address=null"])
    assert cfg.cluster.ray_address is None
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_config(None, ["trainer.lr=null"])
