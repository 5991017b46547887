"""`slipstream bench soak` on the tiny model: one inference server kill and one trainer kill, each recovered
before the next, then the report. The soak stops when its two kills have recovered, never on the clock,
and its ground-truth accounting finds no group lost or trained twice; a run with a group taken out of the
trained record, or one recorded twice, is counted as such."""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.config import load_config, to_yaml
from slipstream.pipeline.checkpoint import UIDS_FILE
from slipstream.system.soak import QUICKSTART, RSS_FILE, _parser, account, main, soak_overrides
from tests.pipeline.conftest import pipeline_config

ROLES = {"driver", "queue", "rollouter", "server-0", "trainer-0"}


def test_soak_survives_a_server_and_a_trainer_kill_and_loses_nothing(
    ray_pools, tiny_model_path, tmp_path, capsys
):
    base = tmp_path / "tiny.yaml"
    base.write_text(to_yaml(pipeline_config(tmp_path, tiny_model_path, "trainer.checkpoint_every=2")))
    argv = ["--config", str(base), "--out", str(tmp_path / "soak"), "--kills", "2", "--kill-every", "2",
            "--warmup-steps", "1", "--json", "trainer.checkpoint_every=2"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert report["stop_reason"] == "2 kills done"
    assert [k["kind"] for k in report["kills"]] == ["server", "trainer"]
    assert all(k["recovered_step"] is not None for k in report["kills"])
    assert report["restarts"] == {"server-0": 1, "trainer": 1}
    assert set(report["rss_mb_start"]) == set(report["rss_mb_end"]) == ROLES
    assert all(mb > 0 for mb in report["rss_mb_start"].values())
    assert all(mb > 0 for mb in report["rss_mb_end"].values())
    assert set(report["restarted_roles"]) == {"server-0", "trainer-0"}  # new processes, new pids
    assert isinstance(report["minutes"], float)
    assert report["groups_lost"] == 0 and report["groups_duplicated"] == 0
    assert report["groups_partial"] == 0 and report["groups_unexpected"] == 0
    assert report["samples_trained"] == report["steps"] * 2 * 4  # batch_groups x n of the tiny config
    assert report["groups_trained"] + report["groups_owed_at_end"] == report["groups_admitted"]
    run_dir = Path(report["run_dir"])
    samples = (run_dir / RSS_FILE).read_text().splitlines()
    assert len(samples) == report["steps_run"]

    # The accounting sees a lost and a twice-trained group in this run's own records, edited.
    cfg = load_config(str(base), [*soak_overrides(tmp_path / "soak"), "trainer.checkpoint_every=2"])
    lines = (run_dir / UIDS_FILE).read_text().splitlines()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    group = first["uids"][0].rsplit("-", 1)[0]
    one_gone = dict(first, uids=[u for u in first["uids"] if u.rsplit("-", 1)[0] != group])
    (run_dir / UIDS_FILE).write_text("\n".join([json.dumps(one_gone), *lines[1:]]) + "\n")
    assert account(cfg, run_dir, report["steps"])["groups_lost"] == 1
    again = dict(second, uids=second["uids"] + [u for u in first["uids"] if u.rsplit("-", 1)[0] == group])
    (run_dir / UIDS_FILE).write_text("\n".join([lines[0], json.dumps(again), *lines[2:]]) + "\n")
    counted = account(cfg, run_dir, report["steps"])
    assert (counted["groups_duplicated"], counted["groups_lost"]) == (1, 0)


def test_the_soak_config_restarts_parts_and_cycles_the_prompts(tmp_path):
    args = _parser().parse_args(["--minutes", "5", "trainer.checkpoint_every=3"])
    cfg = load_config(QUICKSTART, [*soak_overrides(tmp_path), *args.overrides])
    assert cfg.cluster.restart_servers and cfg.cluster.restart_trainer and cfg.cluster.max_restarts > 1000
    assert cfg.run.record_uids and not cfg.run.resume and cfg.run.total_steps == 0
    assert cfg.data.epochs >= 1000 and cfg.async_.mode == "fully_async"
    assert cfg.trainer.checkpoint_every == 3  # the user's override wins
    assert cfg.model.path == load_config(QUICKSTART).model.path  # the quickstart's workload as is
