"""Placement: the plan (which part asks for what) and the fit against nodes, at the recipes' full size.
The same on real Ray clusters with declared GPUs is in ``tests/cluster/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import prepare_config
from slipstream.pipeline.placement import Node, fit, local_resources, plan, shortfall

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"
DAPO = RECIPES / "qwen2.5-7b-dapo-math-64x64.yaml"
QWEN3 = RECIPES / "qwen3-30b-a3b-grpo-math-sglang-fsdp.yaml"


def recipe(path: Path, *overrides: str):
    return prepare_config(load_config(path, list(overrides)))[0]


def nodes(pool: str, count: int, gpus: int = 8, prefix: str = "") -> list[Node]:
    return [Node(f"{prefix}{pool}{i:04d}", "10.0.0.1", {"GPU": gpus, pool: gpus}) for i in range(count)]


def test_only_gpu_parts_take_pool_units():
    groups, parts = plan(recipe(DAPO))
    assert groups["trainer"] == [{"GPU": 1.0, "trainer_pool": 1.0}] * 64
    assert groups["rollout"] == [{"GPU": 4.0, "rollout_pool": 4.0}] * 16
    cpu = {p.name: p for p in parts if p.group is None}
    assert set(cpu) == {"queue", "rollouter"} and all(not p.demand for p in cpu.values())


def test_both_recipes_fit_their_full_size_and_one_gpu_less_names_the_part_left_out():
    for path, trainer_nodes, rollout_nodes in ((DAPO, 8, 8), (QWEN3, 4, 12)):
        cfg = recipe(path)
        groups, parts = plan(cfg)
        cluster = nodes("trainer_pool", trainer_nodes) + nodes("rollout_pool", rollout_nodes)
        assert all(n is not None for placed in fit(groups, cluster).values() for n in placed), path.name
        short = cluster[:-1] + [Node("last", "10.0.0.9", {"GPU": 7, "rollout_pool": 7})]
        assigned = fit(groups, short)
        message = shortfall(cfg, parts, short, assigned)
        last = f"server{cfg.rollout.num_servers - 1}"
        assert f"1 of {len(groups['trainer']) + len(groups['rollout'])} reserved parts do not fit" in message
        assert f"{last} needs {{GPU: 4, rollout_pool: 4}}" in message, message


def test_the_pool_of_a_part_is_never_borrowed_from_the_other_pool():
    cfg = recipe(DAPO, "trainer.num_ranks=72")  # 8 more ranks than trainer GPUs; rollout nodes have GPUs free
    groups, parts = plan(cfg)
    cluster = nodes("trainer_pool", 8) + nodes("rollout_pool", 9)
    assigned = fit(groups, cluster)
    assert assigned["trainer"].count(None) == 8
    assert "rank64, rank65 ... rank71 (8 parts) need {GPU: 1, trainer_pool: 1} each" in shortfall(
        cfg, parts, cluster, assigned
    )


def test_judge_servers_the_run_starts_take_bundles_of_the_rollout_pool():
    judged = ("reward.sources={math_dapo: service}", "reward.service.launch.model_path=/judge")
    cfg = recipe(
        DAPO, *judged, "reward.service.launch.num_servers=2", "reward.service.launch.gpus_per_server=2"
    )
    groups, parts = plan(cfg)
    assert (
        groups["rollout"]
        == [{"GPU": 4.0, "rollout_pool": 4.0}] * 16 + [{"GPU": 2.0, "rollout_pool": 2.0}] * 2
    )
    judges = [p for p in parts if p.name.startswith("judge")]
    assert [(p.name, p.pool, p.group, p.bundle) for p in judges] == [
        ("judge0", "rollout", "rollout", 16),
        ("judge1", "rollout", "rollout", 17),
    ]
    cluster = nodes("trainer_pool", 8) + nodes("rollout_pool", 8)  # the servers use every rollout GPU
    message = shortfall(cfg, parts, cluster, fit(groups, cluster))
    assert "judge0, judge1 need {GPU: 2, rollout_pool: 2} each" in message, message
    assert "reward.service.launch.num_servers" in message
    # The judges' GPUs default to the rollout servers'; no data source scored by the service: no judge.
    assert plan(recipe(DAPO, *judged))[0]["rollout"][-1] == {"GPU": 4.0, "rollout_pool": 4.0}
    assert not [p for p in plan(recipe(DAPO, judged[1]))[1] if p.name.startswith("judge")]


def test_colocated_layout_needs_one_gpu_per_part_and_no_more_servers_than_ranks():
    cfg = load_config(None, ["cluster.colocate=true", "cluster.gpus_per_server=1", "cluster.gpus_per_trainer_rank=1",
                             "trainer.device=cuda", "weightsync.backend=ipc"])  # fmt: skip
    groups, parts = plan(cfg)
    assert groups == {"colocated": [{"GPU": 1.0, "trainer_pool": 1.0, "rollout_pool": 1.0}]}
    shares = {p.name: p.demand for p in parts if p.group}
    assert shares == {
        "rank0": {"GPU": 0.5, "trainer_pool": 1.0},
        "server0": {"GPU": 0.5, "rollout_pool": 1.0},
    }
    with pytest.raises(ConfigError, match="cluster.colocate: .*gpus_per_server=1"):
        plan(load_config(None, ["cluster.colocate=true"]))
    with pytest.raises(ConfigError, match="rollout.num_servers <= trainer.num_ranks"):
        plan(load_config(None, ["cluster.colocate=true", "cluster.gpus_per_server=1",
                                "cluster.gpus_per_trainer_rank=1", "rollout.num_servers=2"]))  # fmt: skip


def test_a_local_start_gives_both_pools_one_unit_per_gpu():
    cfg = load_config(None, [])
    assert local_resources(cfg, 0) == {"rollout_pool": 1.0, "trainer_pool": 1.0}
    assert local_resources(cfg, 8) == {"rollout_pool": 8.0, "trainer_pool": 8.0}
