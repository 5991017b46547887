"""Fixtures of the rollouter tests: one embedded server process shared by every test module here.

Starting a server costs a few seconds of imports and model loading on a 2-core machine, so the tests share
it (session scope) and keep their requests independent of each other (own rids, nothing left paused).
"""

from __future__ import annotations

import asyncio

import pytest

from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
from slipstream.rollouter.launch import launch_server
from slipstream.serverkinds import server_kind

# Small limits keep memory low; 1 thread because the test machine is shared.
TEST_ENGINE = EmbeddedServerConfig(
    num_threads=1, max_model_len=1024, kv_cache_tokens=16384, kv_page_size=64, max_batch_tokens=512, seed=0
)


def run(coro, timeout_s: float = 120.0):
    """Run a coroutine in a fresh event loop with an overall timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def start_embedded(model_path, tmp_dir, name: str):
    cfg = RolloutConfig(embedded=TEST_ENGINE)
    server = launch_server(server_kind("embedded"), model_path, cfg=cfg, log_path=tmp_dir / f"{name}.log")
    try:
        server.wait_healthy(timeout_s=180)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def embedded_server(tiny_model_path, tmp_path_factory):
    """A `slipstream serve` process on loopback with the tiny model (weight version 0)."""
    server = start_embedded(tiny_model_path, tmp_path_factory.mktemp("servers"), "shared")
    yield server
    server.stop()
