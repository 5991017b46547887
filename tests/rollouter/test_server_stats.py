"""The servers' own counters become per-step rates: throughput, prefix-cache hit rate, prefill and decode
time per request; a restarted server's counters (back at zero) are skipped, not read as negative work."""

from __future__ import annotations

import asyncio

from slipstream.rollouter.server_stats import ServerStats, parse_prometheus
from slipstream.serverkinds.vllm import VLLM_COUNTERS

METRICS = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 460.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1280.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 460.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 40.0
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_decode_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 3.0
"""


def test_vllm_metrics_parse_into_our_counters():
    counters = parse_prometheus(METRICS, VLLM_COUNTERS)
    assert counters == {
        "prompt_tokens": 460.0,
        "generated_tokens": 1280.0,
        "prefix_cache_queries": 460.0,
        "prefix_cache_hits": 256.0,
        "prefill_s": 2.5,
        "prefill_requests": 10.0,
        "decode_s": 40.0,
        "decode_requests": 10.0,
    }
    two_engines = METRICS + 'vllm:generation_tokens_total{engine="1",model_name="m"} 20.0\n'
    assert parse_prometheus(two_engines, VLLM_COUNTERS)["generated_tokens"] == 1300.0


class Server:
    def __init__(self, url: str) -> None:
        self.base_url = url
        self.counters: dict[str, float] | None = {}

    async def engine_counters(self):
        return dict(self.counters) if self.counters is not None else None


def test_rates_over_the_servers_between_collects():
    a, b = Server("http://a"), Server("http://b")
    stats = ServerStats(lambda: [a, b])
    a.counters = {"prompt_tokens": 100.0, "prefix_cache_queries": 100.0, "prefix_cache_hits": 0.0}
    b.counters = {"prompt_tokens": 50.0, "prefix_cache_queries": 50.0, "prefix_cache_hits": 0.0}
    asyncio.run(stats.poll())
    stats.collect()
    a.counters = {"prompt_tokens": 200.0, "prefix_cache_queries": 200.0, "prefix_cache_hits": 64.0,
                  "decode_s": 8.0, "decode_requests": 4.0}  # fmt: skip
    b.counters = {"prompt_tokens": 150.0, "prefix_cache_queries": 150.0, "prefix_cache_hits": 64.0}
    asyncio.run(stats.poll())
    out = stats.collect()
    assert out["server/prefix_cache_hit_rate"] == 128.0 / 200.0
    assert out["server/decode_s_mean"] == 2.0
    assert out["server/prompt_tokens_per_s"] > 0 and "server/prefill_s_mean" not in out


def test_a_restarted_server_is_skipped_and_none_reports_nothing():
    a = Server("http://a")
    stats = ServerStats(lambda: [a])
    a.counters = {"generated_tokens": 500.0}
    asyncio.run(stats.poll())
    assert stats.collect() == {}  # a first reading is only the baseline (what it counted before the run)
    a.counters = {"generated_tokens": 20.0}  # restarted: back near zero
    asyncio.run(stats.poll())
    assert stats.collect() == {}
    a.counters = {"generated_tokens": 120.0}
    asyncio.run(stats.poll())
    assert stats.collect()["server/generated_tokens_per_s"] > 0
    quiet = Server("http://q")
    quiet.counters = None  # a kind without counters
    silent = ServerStats(lambda: [quiet])
    asyncio.run(silent.poll())
    assert silent.collect() == {}
