"""Losing a node mid-run, on simulated nodes (``ray.cluster_utils.Cluster``; a node's processes are killed at
once, as when a machine goes away):

* a rollout node: the server it held is restarted where the rollout pool has room; with no room the run
  goes on with the servers left; losing the rollouter's node stops the run, naming the node;
* the trainer node (trainer ranks and the queue server): the run stops, naming it, and ``run.resume``
  continues from the last checkpoint with every prompt trained once.
"""

from __future__ import annotations

import pytest

from slipstream.pipeline import PartFailed, Pipeline
from slipstream.pipeline.checkpoint import read_trained_uids
from tests.pipeline.conftest import pipeline_config
from tests.pipeline.test_pipeline import assert_each_prompt_trained_once

MULTI_NODE = ("queue.host=0.0.0.0", "cluster.server_host=0.0.0.0", "weightsync.master_address=0.0.0.0")
GPU_ROLLOUT = {"num_cpus": 0, "num_gpus": 1, "resources": {"rollout_pool": 1}}
TRAINER = {"num_cpus": 0, "resources": {"trainer_pool": 1}}


@pytest.fixture
def cluster():
    """A head with no pool (the driver's node) and the nodes a test adds; connected."""
    import ray
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    yield made
    ray.shutdown()
    made.shutdown()


def connect(cluster, *nodes: dict) -> None:
    import ray

    for node in nodes:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)


def kill_node_of(cluster, pipeline, part: str) -> str:
    """Kill every process of the node that holds ``part`` (no graceful stop); return its node id."""
    node_id = next(s.node_id for s in pipeline.placement.layout() if s.part == part)
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    wait_for(
        lambda: node_id not in {n["NodeID"] for n in ray_nodes() if n["Alive"]}, "Ray to see the node gone"
    )
    return node_id


def ray_nodes() -> list[dict]:
    import ray

    return ray.nodes()


def wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    """Wait until ``condition()`` holds (a state, not a delay); the timeout only guards against a hang."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def config(tmp_path, model, *overrides: str):
    return pipeline_config(tmp_path, model, "async.mode=fully_async", "cluster.restart_servers=true", *MULTI_NODE,
                           *overrides)  # fmt: skip


@pytest.mark.slow
def test_a_lost_rollout_node_has_its_server_restarted_where_the_pool_has_room(
    cluster, tiny_model_path, tmp_path
):
    connect(cluster, TRAINER, GPU_ROLLOUT, GPU_ROLLOUT, GPU_ROLLOUT)  # one rollout node to spare
    lost = []

    def on_step(pipeline, version, metrics):
        if version == 2 and not lost:
            lost.append(kill_node_of(cluster, pipeline, "server1"))
        elif version == 3:  # the server comes back on the spare node and takes requests again
            wait_for(
                lambda: pipeline.poll_parts() or pipeline.restarts and not pipeline.servers_restarting,
                "a restart",
            )

    cfg = config(
        tmp_path, tiny_model_path, "run.total_steps=6", "rollout.num_servers=2", "cluster.gpus_per_server=1"
    )
    result = Pipeline(cfg, on_step=on_step).run()
    assert lost and result.restarts == {"server-1": 1} and result.version == 6
    assert_each_prompt_trained_once(result.run_dir, 6)


@pytest.mark.slow
def test_a_lost_rollout_node_with_no_room_left_leaves_the_run_on_the_servers_left(
    cluster, tiny_model_path, tmp_path, caplog
):
    connect(cluster, TRAINER, GPU_ROLLOUT, GPU_ROLLOUT)  # no room to spare
    lost = []

    def on_step(pipeline, version, metrics):
        if version == 2 and not lost:
            lost.append(kill_node_of(cluster, pipeline, "server1"))
        elif version == 3:  # the restart finds no room: server1 waits, server0 carries the run
            wait_for(lambda: pipeline.poll_parts() or pipeline.servers_without_room == {1}, "no room")

    cfg = config(
        tmp_path, tiny_model_path, "run.total_steps=6", "rollout.num_servers=2", "cluster.gpus_per_server=1"
    )
    result = Pipeline(cfg, on_step=on_step).run()
    assert lost and result.version == 6
    assert "inference server 1 lost its node and the rollout pool has no room left" in caplog.text
    assert_each_prompt_trained_once(result.run_dir, 6)


@pytest.mark.slow
def test_a_lost_rollouter_node_stops_the_run_naming_it(cluster, tiny_model_path, tmp_path):
    connect(cluster, TRAINER, GPU_ROLLOUT)
    lost = []

    def on_step(pipeline, version, metrics):
        if version == 2 and not lost:
            lost.append(kill_node_of(cluster, pipeline, "rollouter"))

    with pytest.raises(PartFailed) as failed:
        Pipeline(config(tmp_path, tiny_model_path, "run.total_steps=6", "cluster.gpus_per_server=1"),
                 on_step=on_step).run()  # fmt: skip
    message = str(failed.value)
    assert lost and f"[{lost[0][:8]}] (holding server0, rollouter)" in message and "run.resume" in message, (
        message
    )


@pytest.mark.slow
def test_a_lost_trainer_node_stops_the_run_and_resume_loses_nothing(cluster, tiny_model_path, tmp_path):
    connect(cluster, TRAINER, GPU_ROLLOUT)
    lost = []

    def on_step(pipeline, version, metrics):
        if version == 3 and not lost:
            lost.append(kill_node_of(cluster, pipeline, "rank0"))

    args = ("run.total_steps=5", "cluster.gpus_per_server=1", "trainer.checkpoint_every=3",
            "cluster.restart_trainer=true")  # fmt: skip
    with pytest.raises(PartFailed) as failed:
        Pipeline(config(tmp_path, tiny_model_path, *args), on_step=on_step).run()
    assert lost and lost[0][:8] in str(failed.value) and "run.resume" in str(failed.value), str(failed.value)
    assert max(read_trained_uids(tmp_path / "runs" / "test")) >= 3
    cluster.add_node(**TRAINER)  # a replacement node joins; the same command resumes
    cluster.wait_for_nodes()
    result = Pipeline(config(tmp_path, tiny_model_path, *args)).run()
    assert result.version == 5
    assert_each_prompt_trained_once(result.run_dir, 5)
