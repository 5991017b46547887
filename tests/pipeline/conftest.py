"""Fixtures of the pipeline tests: one local Ray instance for this package's tests (starting Ray costs
~12 s on a 2-core machine; it is shut down when they end, so later tests start their own), the tiny
model and a config that runs the whole pipeline on it in seconds per step."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from slipstream.config import load_config
from slipstream.pipeline.actors import wait_for_own_children


@contextlib.contextmanager
def local_ray():
    """A new local Ray instance with the two pool resources, as `slipstream train` runs it; shut down after."""
    import os

    import ray

    key = "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"
    before = os.environ.get(key)
    os.environ[key] = "1"  # as `slipstream train` runs (read by ray.init, inherited by the workers)
    ray.init(
        address="local",  # a new instance, never a cluster some other test or user started here
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        resources={"rollout_pool": 1, "trainer_pool": 1},
    )
    wait_for_own_children()  # else later tests in this process lose their children's exit codes
    try:
        yield
    finally:
        ray.shutdown()
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


@pytest.fixture(scope="package")  # tests/pipeline is a package, so this ends with its last test
def ray_pools():
    """A local Ray with the two pool resources, shared by every pipeline run of this package."""
    with local_ray():
        yield


def write_prompts(path: Path, n: int) -> Path:
    """``n`` arithmetic prompts with distinct indices (a prompt index is trained at most once per run)."""
    from slipstream.agents.datagen import make_rows

    with path.open("w") as f:
        for row in make_rows("arithmetic", n, seed=0):
            f.write(json.dumps(row) + "\n")
    return path


def pipeline_config(tmp_path: Path, model_path, *overrides: str, prompts: int = 12):
    """A run on the tiny model: 2 groups of 4 samples per step, short responses, 1 thread per process."""
    data = write_prompts(tmp_path / "prompts.jsonl", prompts)
    return load_config(
        None,
        [
            f"model.path={model_path}",
            f"data.train_files=[{data}]",
            "data.shuffle=false",
            f"run.output_dir={tmp_path / 'runs'}",
            "run.name=test",
            "run.record_uids=true",
            "wandb.mode=disabled",
            "trainer.device=cpu",
            "trainer.batch_groups=2",
            "trainer.micro_batch_tokens=1024",
            "trainer.lr=1e-3",
            "trainer.checkpoint_every=0",
            "rollout.n=4",
            "rollout.sampling.max_new_tokens=12",
            "rollout.embedded.num_threads=1",
            "rollout.embedded.max_model_len=256",
            "rollout.embedded.kv_cache_tokens=2048",
            "rollout.embedded.kv_page_size=32",
            "rollout.embedded.max_batch_tokens=512",
            "reward.num_workers=1",
            "queue.shm_bytes_per_unit=4194304",
            "queue.io_threads=1",
            # Steps take about a second; a lease a killed trainer could not give back returns in 30 s.
            "queue.lease_timeout_s=30",
            "cluster.trainer_threads=1",
            "cluster.health_interval_s=0.5",
            "weightsync.device=cpu",
            "weightsync.bucket_mb=4",
            "weightsync.timeout_s=60",
            *overrides,
        ],
    )


def group_of(uid: str) -> str:
    """`e0-p7-a1-3` -> `e0-p7` (the prompt, whatever the attempt)."""
    parts = uid.split("-")
    return f"{parts[0]}-{parts[1]}"
