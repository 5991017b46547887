"""Fixtures of the queue tests: hand-built groups and servers (in this process or as a child process)."""

from __future__ import annotations

import pytest

from slipstream.queue.config import QueueConfig


@pytest.fixture
def server(tmp_path):
    """Factory of in-process servers (stopped at teardown): ``server(lease_timeout_s=2)`` -> QueueServer.
    Their snapshot_dir is the test's temporary directory."""
    from slipstream.queue.server import QueueServer

    started = []

    def make(**overrides) -> QueueServer:
        overrides.setdefault("shm_bytes_per_unit", 8 << 20)
        overrides.setdefault("snapshot_dir", str(tmp_path))
        srv = QueueServer(QueueConfig(**overrides)).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def server_process(tmp_path, monkeypatch):
    """Factory of server child processes (stopped at teardown) -> QueueServerHandle. They run in the test's
    temporary directory, which is also their snapshot_dir."""
    from slipstream.queue.server import start_queue_server

    monkeypatch.chdir(tmp_path)

    started = []

    def make(**overrides):
        overrides.setdefault("shm_bytes_per_unit", 8 << 20)
        overrides.setdefault("snapshot_dir", str(tmp_path))
        handle = start_queue_server(QueueConfig(**overrides))
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()
