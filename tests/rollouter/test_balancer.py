"""LoadBalancer: stickiness, least outstanding, capacity, and failover when a server process is killed."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from slipstream.agents.protocol import GenerateOutput, InferenceClient, SamplingParams
from slipstream.rollouter.balancer import LoadBalancer, NoServerAvailable, balancer_from_config
from slipstream.rollouter.clients.base import ServerClient, ServerUnavailable
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import SGLANG
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient
from slipstream.serverkinds.vllm import VLLMClient
from tests.rollouter.conftest import run, start_embedded


class FakeClient(ServerClient):
    """A server in this process: each generate waits until the test releases it (or fails when dead)."""

    kind = "fake"
    default_api = SGLANG

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.started: list[str] = []
        self.release = asyncio.Event()
        self.dead = False
        self.aborted: list[str] = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None) -> GenerateOutput:
        if self.dead:
            raise ServerUnavailable(self.base_url, "connection refused")
        self.started.append(rid)
        await self.release.wait()
        if self.dead:
            raise ServerUnavailable(self.base_url, "connection reset")
        return GenerateOutput(output_ids=[1], logprobs=[-0.1], versions=[0], finish_reason="stop", rid=rid)

    async def abort(self, rid):
        self.aborted.append(rid)

    async def abort_all(self):
        pass

    async def weight_version(self):
        return 0

    async def model_info(self):
        return {}

    async def health(self):
        return not self.dead


SP = SamplingParams(max_new_tokens=4)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_least_outstanding_and_capacity():
    async def main():
        a, b = FakeClient("http://a"), FakeClient("http://b")
        lb = LoadBalancer([a, b], max_concurrent_per_server=2)
        assert isinstance(lb, InferenceClient)
        tasks = [asyncio.create_task(lb.generate([1], SP, rid=f"r{i}")) for i in range(5)]
        await _settle()
        counts = lb.outstanding()
        a.release.set()
        b.release.set()
        outs = await asyncio.gather(*tasks)
        return counts, len(a.started), len(b.started), outs, lb.outstanding()

    counts, na, nb, outs, after = run(main())
    assert counts == {"http://a": 2, "http://b": 2}  # the fifth waits for capacity
    assert na + nb == 5 and {na, nb} == {2, 3}
    assert after == {"http://a": 0, "http://b": 0}
    assert all(o.server in ("http://a", "http://b") for o in outs)


def test_sessions_stick_to_their_server():
    async def main():
        a, b = FakeClient("http://a"), FakeClient("http://b")
        a.release.set()
        b.release.set()
        lb = LoadBalancer([a, b], max_concurrent_per_server=8)
        first = await lb.generate([1], SP, session_id="s1")
        later = [await lb.generate([1], SP, session_id="s1") for _ in range(4)]
        other = await lb.generate([1], SP, session_id="s2")
        return first, later, other

    first, later, other = run(main())
    assert all(o.server == first.server for o in later)
    assert other.server != first.server  # a new session goes to the least loaded, round-robin on ties


def test_failover_moves_requests_and_sessions():
    async def main():
        a, b = FakeClient("http://a"), FakeClient("http://b")
        lb = LoadBalancer([a, b], max_concurrent_per_server=8)
        tasks = [asyncio.create_task(lb.generate([1], SP, rid=f"r{i}", session_id=f"s{i}")) for i in range(4)]
        await _settle()
        on_b = list(b.started)
        b.dead = True
        b.release.set()
        await _settle()
        a.release.set()
        outs = await asyncio.gather(*tasks)
        return on_b, outs, lb.alive(), await lb.generate([1], SP, session_id="s1")

    on_b, outs, alive, again = run(main())
    assert on_b and alive == ["http://a"]
    assert [o.server for o in outs] == ["http://a"] * 4 and again.server == "http://a"


def test_no_server_left_raises():
    async def main():
        a = FakeClient("http://a")
        a.dead = True
        lb = LoadBalancer([a], max_concurrent_per_server=1)
        with pytest.raises(NoServerAvailable):
            await lb.generate([1], SP)
        a.dead = False
        health = await lb.check_health()
        a.release.set()
        return health, await lb.generate([1], SP)

    health, out = run(main())
    assert health == {"http://a": True} and out.server == "http://a"


def test_timeout_aborts_and_retries_elsewhere():
    async def main():
        a, b = FakeClient("http://a"), FakeClient("http://b")
        b.release.set()
        lb = LoadBalancer([a, b], max_concurrent_per_server=4, request_timeout_s=0.2)
        lb._rr = -1  # make the first pick deterministic: "http://a" (least loaded, first in round-robin)
        out = await lb.generate([1], SP, rid="slow")
        return out, a.started, a.aborted

    out, started_a, aborted_a = run(main())
    assert started_a == ["slow"] and aborted_a == ["slow"] and out.server == "http://b"


def test_failover_when_a_server_process_is_killed(embedded_server, tiny_model_path, tmp_path):
    other = start_embedded(tiny_model_path, tmp_path, "doomed")
    try:

        async def main():
            survivor, doomed = SGLangClient(embedded_server.url), SGLangClient(other.url)
            lb = LoadBalancer([survivor, doomed], max_concurrent_per_server=4)
            try:
                sticky = [
                    await lb.generate([1, 2], SamplingParams(max_new_tokens=2), session_id="t")
                    for _ in range(3)
                ]
                params = SamplingParams(max_new_tokens=300)
                tasks = [asyncio.create_task(lb.generate([3, i], params, rid=f"k{i}")) for i in range(8)]
                await asyncio.sleep(0)
                home = dict(lb._where)  # rid -> the server each request was first sent to
                async with httpx.AsyncClient(base_url=other.url, timeout=30) as http:
                    while (await http.get("/model_info")).json()["num_running_requests"] < 1:
                        await asyncio.sleep(0.01)
                os.kill(other.pid, signal.SIGKILL)
                outs = await asyncio.gather(*tasks)
                return sticky, home, outs, lb.alive()
            finally:
                await lb.aclose()

        sticky, home, outs, alive = run(main())
    finally:
        other.stop()
    assert len({o.server for o in sticky}) == 1
    assert alive == [embedded_server.url]
    assert len(outs) == 8 and all(o.finish_reason in ("stop", "length") for o in outs)
    moved = [o for o in outs if home[o.rid] == other.url and o.server == embedded_server.url]
    assert sum(url == other.url for url in home.values()) == 4
    assert moved, "no request was in flight on the killed server"
    assert all(len(o.output_ids) == len(o.logprobs) == len(o.versions) for o in outs)


def test_balancer_from_config():
    async def main():
        cfg = RolloutConfig(backend="vllm", max_concurrent_per_server=3, request_timeout_s=100.0)
        lb = balancer_from_config(server_kind(cfg.backend), cfg, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
        try:
            return [type(c) for c in lb.clients], [c.timeout_s for c in lb.clients], lb
        finally:
            await lb.aclose()

    kinds, timeouts, lb = run(main())
    assert kinds == [VLLMClient, VLLMClient] and timeouts == [160.0, 160.0]
    assert lb.max_concurrent_per_server == 3 and lb.request_timeout_s == 100.0
    assert lb.alive() == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_many_servers_fill_evenly_and_dead_ones_leave_the_ring():
    async def main():
        clients = [FakeClient(f"http://s{i}") for i in range(256)]
        lb = LoadBalancer(clients, max_concurrent_per_server=3)
        tasks = [asyncio.create_task(lb.generate([1], SP, rid=f"r{i}")) for i in range(256 * 3 + 1)]
        await _settle()
        full = lb.outstanding()
        lb.mark_dead("http://s7")
        lb.add(FakeClient("http://late"))  # a new server takes the request that waited for capacity
        await _settle()
        late = lb.outstanding()["http://late"]
        for c in clients:
            c.release.set()
        lb._clients["http://late"].release.set()
        await asyncio.gather(*tasks)
        dead_started = len(clients[7].started)
        more = [await lb.generate([1], SP, rid=f"x{i}") for i in range(600)]
        return full, late, dead_started, len(clients[7].started), {o.server for o in more}

    full, late, dead_before, dead_after, servers = run(main())
    assert set(full.values()) == {3}  # 768 requests: exactly 3 on each of 256 servers, one left waiting
    assert late == 1
    assert dead_after == dead_before  # a dead server gets nothing new
    assert "http://s7" not in servers and len(servers) == 256  # the 255 live ones and the late one
