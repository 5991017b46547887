import pytest

from slipstream.cli import main as cli_main
from slipstream.config import Config, ConfigError, load_config, to_yaml


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


def test_cli_config_show(tmp_path, capsys):
    assert cli_main(["config", "show", str(tmp_path / "nope.yaml")]) == 2
    (tmp_path / "ok.yaml").write_text("trainer:\n  lr: 3.0e-6\n")
    assert cli_main(["config", "show", str(tmp_path / "ok.yaml"), "async.sync_every=3"]) == 0
    out = capsys.readouterr().out
    assert "lr: 3.0e-06" in out and "sync_every: 3" in out
    assert cli_main(["nosuch"]) == 2
