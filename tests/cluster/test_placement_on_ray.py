"""Placement on real Ray clusters with declared GPUs (``ray.cluster_utils.Cluster``: Ray counts the GPUs it
is told about): both recipes at their full size through ``slipstream train --check-placement`` and one GPU
too few; nodes filled exactly with the CPU parts beside them (the case that never started before); a
one-GPU machine with the colocated layout. Each test starts its own cluster, so these live apart from the
pipeline tests' shared local Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config import load_config
from slipstream.pipeline.placement import local_resources
from tests.pipeline.test_placement import DAPO, QWEN3, recipe

SLIPSTREAM = str(Path(sys.executable).with_name("slipstream"))


@pytest.fixture(scope="module")
def recipe_cluster():
    """Head (no pool) + 8 trainer nodes + 12 rollout nodes of 8 GPUs: both recipes at their full size."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for i in range(20):
        pool = "trainer_pool" if i < 8 else "rollout_pool"
        cluster.add_node(num_cpus=0, num_gpus=8, resources={pool: 8}, wait=False)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def check_placement(address: str, config: Path, *overrides: str) -> subprocess.CompletedProcess:
    argv = [
        SLIPSTREAM,
        "train",
        str(config),
        "--check-placement",
        f"cluster.ray_address={address}",
        *overrides,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_check_placement_passes_both_recipes_at_full_size_and_names_the_shortfall(recipe_cluster):
    dapo = check_placement(recipe_cluster.address, DAPO)
    assert dapo.returncode == 0, dapo.stderr
    assert "82 parts on 16 nodes" in dapo.stdout  # 64 ranks, 16 servers, queue, rollouter
    qwen3 = check_placement(recipe_cluster.address, QWEN3)
    assert qwen3.returncode == 0, qwen3.stderr
    assert "58 parts on 16 nodes" in qwen3.stdout  # 32 ranks on 4 nodes, 24 servers on 12
    short = check_placement(recipe_cluster.address, DAPO, "trainer.num_ranks=65")  # one trainer GPU too few
    assert short.returncode == 1
    assert "1 of 81 reserved parts do not fit (rank64 needs {GPU: 1, trainer_pool: 1})" in short.stderr
    assert "the config needs {GPU: 129, rollout_pool: 64, trainer_pool: 65}" in short.stderr.replace(
        "The", "the"
    )


@pytest.fixture
def ray_on(request):
    """A Ray cluster built from ``request.param``'s node list (resources per node), connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=request.param[0])
    for node in request.param[1:]:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _place(placement, name: str) -> tuple[str, list[str]]:
    """Start a probe actor with the part's options; return (its node id, the GPU ids Ray gave it)."""
    import ray

    class Where:  # defined here so that Ray ships it by value (tests/ is not importable on workers)
        def where(self) -> tuple[str, list[str]]:
            return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    return ray.get(ray.remote(Where).options(**placement.options(name)).remote().where.remote(), timeout=60)


@pytest.mark.parametrize(
    "ray_on",
    [[{"num_cpus": 0}, *[{"num_cpus": 0, "num_gpus": 8, "resources": {pool: 8}}
                          for pool in ("trainer_pool", "trainer_pool", "rollout_pool", "rollout_pool")]]],
    indirect=True,
)  # fmt: skip
def test_nodes_filled_exactly_place_every_part_and_cpu_parts_sit_beside_them(ray_on):
    """The DAPO recipe scaled to 2+2 nodes of 8 GPUs: 16 ranks and 4 servers of 4 GPUs fill every GPU, and
    the queue and the rollouter still land (before, they took a sliver of a unit and rank15/server3 waited
    forever)."""
    from slipstream.pipeline.placement import Placement

    cfg = recipe(DAPO, "trainer.num_ranks=16", "rollout.num_servers=4")
    placement = Placement.reserve(cfg, timeout_s=60)
    try:
        slots = {s.part: s for s in placement.layout()}
        trainer_nodes = {slots[f"rank{i}"].node_id for i in range(16)}
        rollout_nodes = {slots[f"server{i}"].node_id for i in range(4)}
        assert len(trainer_nodes) == 2 and len(rollout_nodes) == 2 and not trainer_nodes & rollout_nodes
        node, gpus = _place(placement, "rank15")
        assert node == slots["rank15"].node_id and len(gpus) == 1
        node, gpus = _place(placement, "server3")
        assert node == slots["server3"].node_id and len(gpus) == 4
        assert (
            _place(placement, "queue") == (slots["queue"].node_id, [])
            and slots["queue"].node_id in trainer_nodes
        )
        assert _place(placement, "rollouter")[0] in rollout_nodes
    finally:
        placement.release()


@pytest.mark.parametrize(
    "ray_on",
    [[{"num_cpus": 1, "num_gpus": 1, "resources": local_resources(load_config(None, []), 1)}]],
    indirect=True,
)
def test_one_gpu_machine_colocates_a_rank_and_a_server_on_its_gpu_and_splits_the_default_layout(ray_on):
    from slipstream.pipeline.placement import Placement, PlacementError

    gpu = ["trainer.device=cuda", "cluster.gpus_per_server=1", "cluster.gpus_per_trainer_rank=1"]
    split = load_config(None, gpu)
    with pytest.raises(
        PlacementError, match=r"server0 needs \{GPU: 1, rollout_pool: 1\}.*cluster.colocate=true"
    ):
        Placement.reserve(split, timeout_s=5)
    colocated = [*gpu, "cluster.colocate=true", "weightsync.backend=ipc"]  # NCCL cannot share one GPU
    placement = Placement.reserve(load_config(None, colocated), timeout_s=30)
    try:
        assert _place(placement, "rank0")[1] == _place(placement, "server0")[1] == ["0"]
    finally:
        placement.release()
