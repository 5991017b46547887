import json

from slipstream.config import load_config
from slipstream.metrics import MetricsLogger, read_metrics
from slipstream.plot import main as plot_main
from slipstream.plot import series


def test_metrics_jsonl_and_plot(tmp_path, capsys):
    cfg = load_config(None, ["wandb.mode=disabled"])
    with MetricsLogger(tmp_path, cfg, total_steps=5) as log:
        for step in range(1, 6):
            log.log(
                step,
                {
                    "trainer/reward_mean": step / 10,
                    "trainer/staleness_versions_mean": 0.5,
                    "rollouter/idle_ratio": 0.1,
                    "trainer/tokens_per_s": 100.0 + step,
                    "trainer/loss": float("nan"),
                },
            )
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["trainer/reward_mean"] == 0.3 and records[0]["trainer/loss"] is None
    assert "step 5/5" in capsys.readouterr().err
    # A torn last line (a killed run) is skipped, not fatal.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "trainer/rew')
    assert len(read_metrics(tmp_path)) == 5
    assert plot_main([str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert {p.rsplit("/", 1)[-1] for p in written} == {
        "reward.png",
        "staleness.png",
        "idle_ratio.png",
        "throughput.png",
        "summary.png",
    }


def test_series_matches_patterns():
    recs = [
        {"step": 1, "a/reward_mean": 1.0, "b/reward_mean": 2, "flag": True},
        {"step": 2, "a/reward_mean": 3.0},
    ]
    data = series(recs, (r"reward_mean$",))
    assert data == {"a/reward_mean": ([1, 2], [1.0, 3.0]), "b/reward_mean": ([1], [2.0])}


def test_plot_missing_run(tmp_path, capsys):
    assert plot_main([str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_wandb_offline(tmp_path):
    cfg = load_config(None, ["wandb.mode=offline", "run.name=t"])
    with MetricsLogger(tmp_path, cfg) as log:
        log.log(1, {"trainer/reward_mean": 0.5})
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
