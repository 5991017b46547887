"""A two-node CPU cluster started by the launch scripts (a trainer head and a rollout worker, both on this
machine's loopback) trains 2 steps through ``scripts/submit.sh``, with the source uploaded and with the
installed package, and places the trainer and the servers on their own nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.utils.net import free_port
from tests.pipeline.conftest import write_prompts

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WAIT_NODES = """
import socket, sys, time
from slipstream.pipeline.controller import send_ray_token_if_any
send_ray_token_if_any()  # as `slipstream train` does when it joins a cluster
host, port = sys.argv[1].split(":")
deadline = time.monotonic() + 180
while True:  # the head's GCS listens a few seconds after `ray start` begins
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
import ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.5)
sys.exit(0 if sum(n["Alive"] for n in ray.nodes()) >= int(sys.argv[2]) else 1)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env['PATH']}"
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Head (trainer pool) + worker (rollout pool) through scripts/launch_*_cluster.sh; yields the job URL."""
    logs = tmp_path_factory.mktemp("nodes")
    port, dashboard = free_port(), free_port()
    common: list[str] = []
    nodes = []
    try:
        nodes.append(_start(["scripts/launch_trainer_cluster.sh", "--head", "--port", str(port),
                             "--dashboard-port", str(dashboard), *common], logs / "head.log"))  # fmt: skip
        _wait(f"127.0.0.1:{port}", 1)
        nodes.append(_start(["scripts/launch_rollout_cluster.sh", "--address", f"127.0.0.1:{port}", *common],
                            logs / "worker.log"))  # fmt: skip
        _wait(f"127.0.0.1:{port}", 2)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        for node in reversed(nodes):  # `ray start --block` stops its node's processes on SIGTERM
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=120)


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(address: str, nodes: int) -> None:
    subprocess.run(
        [sys.executable, "-c", WAIT_NODES, address, str(nodes)], env=_env(), check=True, timeout=240
    )


def tiny_config(tmp_path: Path, model: Path) -> Path:
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    path = tmp_path / "two-nodes.yaml"
    path.write_text(f"""
run: {{name: two-nodes, output_dir: {tmp_path / "runs"}, total_steps: 2}}
model: {{path: {model}}}
data: {{train_files: [{data}], shuffle: false}}
wandb: {{mode: disabled}}
trainer: {{device: cpu, batch_groups: 2, micro_batch_tokens: 1024, checkpoint_every: 0}}
rollout:
  n: 2
  sampling: {{max_new_tokens: 8}}
  embedded: {{num_threads: 1, max_model_len: 256, kv_cache_tokens: 1024, kv_page_size: 32, max_batch_tokens: 256}}
reward: {{num_workers: 1}}
queue: {{host: 0.0.0.0, shm_bytes_per_unit: 4194304, io_threads: 1}}
weightsync: {{device: cpu, bucket_mb: 4, master_address: 0.0.0.0}}
cluster: {{server_host: 0.0.0.0, trainer_threads: 1}}
""")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("upload", ["1", "0"])
def test_submit_trains_two_steps_on_two_nodes(two_nodes, tiny_model_path, tmp_path, upload):
    config = tiny_config(tmp_path, tiny_model_path)
    env = {**_env(), "RAY_ADDRESS": two_nodes, "SLIPSTREAM_UPLOAD": upload}
    done = subprocess.run(["scripts/submit.sh", str(config)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "runs/two-nodes/metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]
    placed = next(line for line in done.stdout.splitlines() if "placement: " in line)
    by_node = dict(part.split(": ", 1) for part in placed.split("placement: ", 1)[1].split("; "))
    assert len(by_node) == 2, placed  # the trainer's node and the rollout node
    assert any("rank0" in parts and "queue" in parts for parts in by_node.values()), placed
    assert any("server0" in parts and "rollouter" in parts for parts in by_node.values()), placed


@pytest.mark.slow
def test_a_run_without_ray_address_starts_its_own_ray_beside_a_running_cluster(
    two_nodes, tiny_model_path, tmp_path
):
    """With `cluster.ray_address: null` a run starts its own local Ray even while a `ray start` cluster runs on
    the machine (a bare ray.init() would join that cluster and refuse the run's pool resources)."""
    config = tiny_config(tmp_path, tiny_model_path)
    argv = [str(BIN / "slipstream"), "train", str(config), "--check-placement", "cluster.ray_address=null"]
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 parts on 1 nodes" in done.stdout
