"""Judge servers the pipeline starts (``reward.service.launch``), across real processes on the tiny model.

The tiny model is the judge too: its replies hold no ``Score: <number>``, so every sample scores
``reward.service.failure_score`` with the reason as its reward error. That the judge generated tokens
proves the reward service's calls reached it; that it still serves weight version 0 while the rollout
server serves the trainer's proves no push reached it. The judge is killed after step 1: it comes back on
a new port, and the tokens the new process generates prove the reward service was handed its new URL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest
import ray

from slipstream.config import ConfigError
from slipstream.pipeline import Pipeline
from slipstream.pipeline.modes import check_config, prepare_config
from slipstream.pipeline.placement import format_layout, plan
from tests.pipeline.conftest import pipeline_config

FAILURE_SCORE = -0.5


def model_info(url: str) -> dict:
    return httpx.get(f"{url}/model_info", timeout=10).json()


def test_a_judge_pool_started_by_the_pipeline_scores_and_never_takes_a_push(
    ray_pools, tiny_model_path, tmp_path
):
    cfg = pipeline_config(
        tmp_path, tiny_model_path, "async.mode=sync", "run.total_steps=3",
        "reward.sources={arithmetic: service}",
        f"reward.service.launch.model_path={tiny_model_path}",
        "reward.service.judge_max_tokens=4",
        "reward.service.retries=1",
        "reward.service.backoff_s=0.05",
        "reward.service.timeout_s=30",
        "reward.timeout_s=60",
        f"reward.service.failure_score={FAILURE_SCORE}",
        prompts=6,
    )  # fmt: skip
    assert [p.name for p in plan(cfg)[1] if p.group == "rollout"] == ["server0", "judge0"]
    seen: list[tuple[int, dict, dict]] = []

    judge_urls: list[str] = []

    def on_step(pipeline, version, metrics):
        parts = pipeline.parts
        assert len(parts.judge_urls) == 1 and parts.judge_urls[0] not in parts.urls
        seen.append((version, model_info(parts.urls[0]), model_info(parts.judge_urls[0])))
        judge_urls.append(parts.judge_urls[0])
        if version == 1:  # reserved in the rollout pool, as `--check-placement` prints it
            layout = pipeline.placement.layout()
            assert [(s.part, s.pool) for s in layout if s.pool == "rollout"][:2] == [
                ("server0", "rollout"),
                ("judge0", "rollout"),
            ]
            assert re.search(r"^judge0 +rollout ", format_layout(layout), re.MULTILINE)
            os.kill(ray.get(parts.judges[0].actor.pid.remote()), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not pipeline.restarts.get("judge-0") or pipeline.supervisor.judges.restarting:
                assert time.monotonic() < deadline, "the judge server did not come back"
                pipeline.poll_parts()
                time.sleep(0.2)

    result = Pipeline(cfg, on_step=on_step).run()
    assert result.version == 3 and result.restarts == {"judge-0": 1}
    assert [v for v, _, _ in seen] == [1, 2, 3]
    for version, server, judge in seen:
        assert server["weight_version"] == str(version)  # the rollout server took every push
        assert judge["weight_version"] == "0"  # the judge took none
    assert seen[0][2]["generated_tokens"] > 0  # the reward service's requests reached the judge
    assert judge_urls[0] != judge_urls[1] == judge_urls[2]  # restarted on a new port
    assert seen[2][2]["generated_tokens"] > 0  # ... and the reward service calls it there
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in records:
        assert rec["trainer/reward_mean"] == FAILURE_SCORE  # malformed verdicts: failure_score each
    assert sum(rec.get("rollouter/reward_errors", 0.0) for rec in records) >= 3 * 2 * 4
    logs = result.run_dir / "logs"
    assert (logs / "judge-embedded-0.log").is_file() and (logs / "judge-0.log").is_file()
    # The first failure's reason is in the rollouter's log: the judge answered, with no score.
    assert "reward service: " in (text := (logs / "rollouter.log").read_text()), text[-2000:]
    assert "malformed judge reply: no `Score: <number>`" in text, text[-2000:]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.service.launch.model_path=/nonexistent/judge"], "reward.service.launch.model_path: `"),
        (
            ["reward.service.launch.backend=sglang", "reward.service.launch.gpus_per_server=0"],
            "reward.service.launch.",  # not installed here, or (where it is) no GPUs
        ),
        (
            ["reward.service.urls=[http://127.0.0.1:1]"],
            "reward.service.urls, reward.service.launch.model_path: both set",
        ),
    ],
)
def test_a_judge_pool_that_cannot_start_fails_the_config_check(tiny_model_path, tmp_path, overrides, message):
    cfg = pipeline_config(
        tmp_path, tiny_model_path, "reward.sources={arithmetic: service}",
        f"reward.service.launch.model_path={tiny_model_path}", *overrides,
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_config(prepare_config(cfg)[0])
    assert str(err.value).startswith(message), str(err.value)
