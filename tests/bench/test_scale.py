"""The simulated servers speak what our SGLang client and weight-sync adapter expect, and a tiny
``slipstream bench scale`` run moves groups through the real queue, rollouter and publisher."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from slipstream.agents.protocol import SamplingParams
from slipstream.serverkinds.embedded import EmbeddedAdapter
from slipstream.serverkinds.sglang import SGLangClient
from slipstream.system.sim_servers import SimPool, SimProfile
from slipstream.utils.http_client import HTTPClient
from slipstream.weightsync.config import WeightSyncConfig


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def _tokens_made(pool: SimPool, rid: str, at_least: int = 1, timeout_s: float = 30.0) -> int:
    """Wait until request ``rid`` runs on the pool's server with at least ``at_least`` tokens made."""
    (server,) = pool.servers
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        req = server.requests.get(rid)
        made = req.made(loop.time()) if req is not None else 0
        if made >= at_least:
            return made
        assert loop.time() < deadline, f"{rid} made {made} tokens, waiting for {at_least}"
        await asyncio.sleep(0.01)


async def _pool(**profile) -> tuple[SimPool, SGLangClient, str]:
    pool = SimPool(SimProfile(**profile))
    (url,) = await pool.start(1)
    return pool, SGLangClient(url), url


def test_generate_returns_tokens_logprobs_and_versions():
    async def main():
        pool, client, _ = await _pool(tokens_per_s=5000, median_tokens=12, length_sigma=0.0)
        try:
            stop = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=64, stop_token_ids=[7]))
            capped = await client.generate([1], SamplingParams(max_new_tokens=5), rid="capped")
            info = await client.model_info()
            return stop, capped, info, await client.health()
        finally:
            await client.aclose()
            await pool.stop()

    stop, capped, info, healthy = run(main())
    assert len(stop.output_ids) == len(stop.logprobs) == len(stop.versions) == 12
    assert stop.finish_reason == "stop" and stop.output_ids[-1] == 7 and stop.prompt_tokens == 3
    assert set(stop.versions) == {0} and all(lp < 0 for lp in stop.logprobs)
    assert capped.finish_reason == "length" and len(capped.output_ids) == 5 and capped.rid == "capped"
    assert info["weight_version"] == "0" and healthy


def test_abort_returns_the_partial_output():
    async def main():
        pool, client, _ = await _pool(tokens_per_s=50, median_tokens=10_000, length_sigma=0.0)
        try:
            task = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=10_000), rid="r1"))
            await _tokens_made(pool, "r1")
            await client.abort("r1")
            one = await task
            other = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=10_000), rid="r2"))
            await _tokens_made(pool, "r2")
            await client.abort_all()
            return one, await other
        finally:
            await client.aclose()
            await pool.stop()

    one, other = run(main())
    for out in (one, other):
        assert out.finish_reason == "abort"
        assert 0 < len(out.output_ids) < 10_000
        assert len(out.logprobs) == len(out.versions) == len(out.output_ids)


def test_weight_update_switches_the_version_of_later_tokens():
    """The embedded adapter's control sequence (in-place pause): tokens before the switch keep version 0,
    tokens after it carry the pushed version, within one request."""

    async def main():
        pool, client, url = await _pool(tokens_per_s=40, median_tokens=10_000, length_sigma=0.0)
        http = HTTPClient()
        adapter = EmbeddedAdapter(url, WeightSyncConfig(device="cpu", pause_mode="in_place"), http)
        try:
            task = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=10_000), rid="r"))
            await _tokens_made(pool, "r")
            await client.pause("in_place")
            await adapter.before(5)
            await adapter.after(5)
            switched = pool.servers[0].requests["r"].spans[-1][1]  # the first token of version 5
            await client.resume()
            await _tokens_made(pool, "r", switched + 1)
            await client.abort("r")
            return await task, await client.weight_version()
        finally:
            await http.aclose()
            await client.aclose()
            await pool.stop()

    out, version = run(main())
    assert version == 5
    assert out.versions[0] == 0 and out.versions[-1] == 5 and out.versions == sorted(out.versions)


def test_groups_per_second_grow_with_servers_and_queue_p99_stays_bounded():
    """What the benchmark exists to show, within one run (ratios, generous bounds, no absolute times): the
    servers are the bottleneck (a slow decode), so 4x the servers gives well over 2x the groups per second,
    while the queue's round trips stay within the same order of magnitude."""
    cmd = [
        sys.executable, "-m", "slipstream.system.scale", "--servers", "2,8", "--warmup-s", "3", "--seconds", "6",
        "--tokens-per-s", "20", "--median-tokens", "8", "--max-new-tokens", "16", "--json",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    few, many = result["rows"]
    keys = {"servers", "groups_s", "queue_p50_us", "queue_p99_us", "fanout_s", "controller_cpu", "rss_mb"}
    assert keys <= set(few) and (few["servers"], many["servers"]) == (2, 8)
    for row in (few, many):
        assert row["groups_total"] > 0 and row["pushes"] >= 1 and row["fanout_s"] is not None
    assert many["groups_s"] > 2.0 * few["groups_s"], (few, many)  # ideal 4x
    assert many["queue_p99_us"] < 20 * max(few["queue_p99_us"], few["queue_p50_us"] * 10), (few, many)
    assert many["queue_p50_us"] <= many["queue_p99_us"]


def test_control_only_push_reaches_many_servers_each_on_its_own_client():
    """The publisher keeps one HTTP client per server (a shared pool is scanned whole on every call), and a
    push with no data plane runs every server's whole control sequence."""
    import threading

    import torch

    from slipstream.system.scale import _control_only_publisher

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pool = SimPool(SimProfile())
    urls = asyncio.run_coroutine_threadsafe(pool.start(64), loop).result(30)
    pub = _control_only_publisher(urls, "abort")
    try:
        report = pub.publish(3, [("w0", torch.zeros(2)), ("w1", torch.zeros(2))])
        clients = {id(a.http) for a in pub.servers.values()}
        pub.remove_server(urls[0])
        left = len(pub._http)
    finally:
        pub.close()
        asyncio.run_coroutine_threadsafe(pool.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert sorted(report.ok) == sorted(urls) and not report.failed
    assert {s.version for s in pool.servers} == {3}
    assert {s.counts["weight_updates"] for s in pool.servers} == {1}
    assert {s.counts["pause"] for s in pool.servers} == {
        1
    }  # the abort at the switch, inside /end_weight_update
    assert len(clients) == 64 and left == 63
