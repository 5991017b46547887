"""Launchers: a failing server's own error reaches the caller; stop is clean; unknown kinds fail loudly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.rollouter.config import RolloutConfig
from slipstream.rollouter.launch import ServerLaunchError, ServerProcess, launch_server, launch_servers
from slipstream.serverkinds import server_kind


def test_failing_server_surfaces_its_error(tmp_path):
    server = launch_server(server_kind("embedded"), tmp_path / "no-such-model", log_path=tmp_path / "bad.log")
    with pytest.raises(ServerLaunchError, match="exited with code 2") as err:
        server.wait_healthy(timeout_s=120)
    assert "unknown model" in str(err.value) and "no-such-model" in str(err.value)
    assert not server.is_alive()


def test_server_that_never_gets_healthy_is_stopped(tmp_path):
    log = tmp_path / "slow.log"
    code = "import sys, time; print('still booting', flush=True); time.sleep(600)"
    with open(log, "ab") as f:
        popen = subprocess.Popen(
            [sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = ServerProcess("embedded", "http://127.0.0.1:9", [sys.executable], log, popen)
    with pytest.raises(ServerLaunchError, match="not healthy after") as err:
        server.wait_healthy(timeout_s=1.0, poll_s=0.1)
    assert "still booting" in str(err.value)
    assert not server.is_alive()


def test_embedded_launch_passes_the_engine_config(tmp_path, embedded_server):
    assert "--max-model-len" in embedded_server.command and "1024" in embedded_server.command
    assert embedded_server.is_alive() and embedded_server.url.startswith("http://127.0.0.1:")


def test_unknown_kind_and_missing_engines_fail_loudly(tmp_path):
    with pytest.raises(
        ValueError, match="^rollout.backend: unknown inference server kind `tgi`; known kinds: "
    ):
        launch_server(server_kind("tgi"), tmp_path)  # the caller resolves the kind; the launcher never does
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ServerLaunchError, match="vllm is not installed"):
            launch_server(server_kind("vllm"), tmp_path, cfg=RolloutConfig(backend="vllm"))


def test_stop_terminates_cleanly(tmp_path):
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "print('ready', flush=True); time.sleep(600)"
    )
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert popen.stdout.readline() == b"ready\n"  # the SIGTERM handler is installed
    server = ServerProcess("embedded", "http://127.0.0.1:9", [sys.executable], tmp_path / "x.log", popen)
    assert server.stop(timeout_s=30) == 0 and not server.is_alive()
    popen.stdout.close()


def test_launch_servers_stops_all_when_one_fails(tmp_path):
    cfg = RolloutConfig(num_servers=2, launch_timeout_s=120)
    with pytest.raises(ServerLaunchError, match="unknown model"):
        launch_servers(server_kind(cfg.backend), cfg, tmp_path / "missing", log_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["embedded-0.log", "embedded-1.log"]
