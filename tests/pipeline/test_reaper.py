"""A `slipstream train` driver killed with SIGKILL leaves no process behind (Ray's agents outlived it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.pipeline.conftest import write_prompts

BIN = Path(sys.executable).parent


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    """Wait until ``condition()`` holds (a state, not a delay); the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_killed_driver_leaves_no_process_behind(tiny_model_path, tmp_path):
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    config = tmp_path / "run.yaml"
    config.write_text(f"""
run: {{name: killed, output_dir: {tmp_path / "runs"}, total_steps: 20}}
model: {{path: {tiny_model_path}}}
data: {{train_files: [{data}], shuffle: false}}
wandb: {{mode: disabled}}
trainer: {{device: cpu, batch_groups: 2, micro_batch_tokens: 1024, checkpoint_every: 0}}
rollout:
  n: 2
  sampling: {{max_new_tokens: 8}}
  embedded: {{num_threads: 1, max_model_len: 256, kv_cache_tokens: 1024, kv_page_size: 32, max_batch_tokens: 256}}
reward: {{num_workers: 1}}
cluster: {{trainer_threads: 1}}
""")
    log = tmp_path / "driver.log"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        driver = subprocess.Popen([str(BIN / "slipstream"), "train", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                  env=env)  # fmt: skip
    try:
        wait_for(lambda: "all parts up" in log.read_text() or driver.poll() is not None, "the run to start")
        assert driver.poll() is None, log.read_text()[-3000:]
        wait_for(lambda: any("Agent" in p.name() for p in psutil.Process(driver.pid).children(recursive=True)),
                 "Ray's agents")  # fmt: skip
        left = {p.pid: p.create_time() for p in psutil.Process(driver.pid).children(recursive=True)}
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    def alive() -> list[str]:
        out = []
        for pid, started in left.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {proc.name()}")
            except psutil.Error:
                continue
        return out

    wait_for(lambda: not alive(), f"the run's processes to go ({alive()})", timeout_s=60)
