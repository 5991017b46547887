"""The whole pipeline with a mixture-of-experts model: a tiny Qwen3-MoE on the quickstart's arithmetic task,
fully async, served by the embedded server with routing replay on. The servers return each token's
experts, the rollouter carries them in the trajectories through the queue, the trainer replays them, and
rewards flow and versions push as with a dense model."""

from __future__ import annotations

import json

from slipstream.pipeline import Pipeline
from tests.pipeline.conftest import pipeline_config


def test_a_tiny_moe_trains_fully_async_with_routing_replay(ray_pools, tiny_moe_models, tmp_path):
    # a random model rarely sums right: the overlong penalty (responses past 4 of the 12 tokens) makes every
    # reward non-zero, so the rewards seen by the trainer are the reward stage's
    keys = ["async.mode=fully_async", "run.total_steps=3", "trainer.moe.routing_replay=rollout",
            "trainer.moe.aux_loss_coef=0.01", "async.sync_every=1", "reward.overlong_buffer_len=8",
            "reward.overlong_penalty_factor=1.0"]  # fmt: skip
    cfg = pipeline_config(tmp_path, tiny_moe_models["qwen3_moe"], *keys, prompts=8)
    result = Pipeline(cfg).run()
    assert result.version == 3
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for rec in records:
        assert rec["sync/servers_ok"] == 1.0 and rec["sync/version"] == rec["step"]
        assert -1.0 <= rec["trainer/reward_mean"] < 0.0
        # every token but each sample's last is routed as the server routed it
        assert 0.9 < rec["trainer/moe_replayed_token_share"] < 1.0
        assert rec["trainer/moe_aux_loss"] > 0
    print({k: [r[k] for r in records] for k in ("trainer/reward_mean", "trainer/moe_replayed_token_share")})
