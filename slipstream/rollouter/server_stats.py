"""What the inference servers themselves counted, as the run's ``server/*`` metrics.

The rollouter sees requests from outside (tokens back, wall time); only a server knows how many prompt tokens
it prefilled, how many of them its prefix cache served, and how long its requests spent in prefill and in
decode. A client whose server exposes such counters returns them from ``engine_counters()`` (vLLM: its
Prometheus ``/metrics``; a client without them returns None). :class:`ServerStats` polls every live server
on the rollouter's event loop, sums the counters over the servers, and each :meth:`ServerStats.collect`
(once per trainer step) turns what changed since the last one into:

  ``server/prompt_tokens_per_s``, ``server/generated_tokens_per_s``  the servers' own throughput
  ``server/prefix_cache_hit_rate``  prompt tokens served from the prefix cache / prompt tokens looked up
  ``server/prefill_s_mean``, ``server/decode_s_mean``  a request's time in prefill and in decode, on average

Counters are cumulative on the servers: a server's first reading is only its baseline, and a server that
restarts starts again from zero, so a negative change is read as a restart and that interval is skipped.

Example::

    stats = ServerStats(lambda: balancer.clients)  # a callable giving the live clients
    task = asyncio.create_task(stats.run(5.0))  # polls every 5 s until cancelled
    ...
    stats.collect()   # {"server/generated_tokens_per_s": 97.3, "server/prefix_cache_hit_rate": 0.61, ...}
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Our names for the counters a server may report (every one optional).
COUNTERS = (
    "prompt_tokens",
    "generated_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefill_s",
    "prefill_requests",
    "decode_s",
    "decode_requests",
)


class CountingClient(Protocol):
    base_url: str

    async def engine_counters(self) -> dict[str, float] | None: ...


def parse_prometheus(text: str, names: Mapping[str, str]) -> dict[str, float]:
    """``{our name: value}`` for each Prometheus sample named in ``names`` (ours -> the server's), summed over
    its label sets; names the text lacks are left out."""
    wanted = {server: ours for ours, server in names.items()}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        ours = wanted.get(name)
        if ours is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[ours] = out.get(ours, 0.0) + value
    return out


class ServerStats:
    """Polls the servers' counters and turns them into per-step rates (module docstring)."""

    def __init__(self, clients: Callable[[], Iterable[Any]]) -> None:
        self._clients = clients
        self._latest: dict[str, dict[str, float]] = {}  # by server URL, the last poll's counters
        self._at_collect: dict[str, dict[str, float]] = {}
        self._collected = time.monotonic()

    async def poll(self) -> None:
        """Read every live server's counters once (a server that fails to answer keeps its last reading)."""
        clients = [c for c in self._clients() if hasattr(c, "engine_counters")]
        results = await asyncio.gather(*(c.engine_counters() for c in clients), return_exceptions=True)
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, dict):
                self._latest[client.base_url] = result
            elif isinstance(result, BaseException):
                log.debug("%s: no counters: %s", client.base_url, result)

    async def run(self, interval_s: float) -> None:
        """Poll every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.poll()
            except Exception:  # metrics must never end generation; say why they stopped
                log.exception("reading the servers' counters failed")
            await asyncio.sleep(interval_s)

    def collect(self) -> dict[str, float]:
        """The ``server/*`` metrics over the time since the last call; empty while no server reported."""
        now = time.monotonic()
        elapsed = max(now - self._collected, 1e-9)
        delta = dict.fromkeys(COUNTERS, 0.0)
        reported = False
        for url, counters in self._latest.items():
            before = self._at_collect.get(url)
            if before is None:  # its first reading: what it counted before this run's first interval
                continue
            changes = {k: counters[k] - before.get(k, 0.0) for k in counters if k in delta}
            if any(v < 0 for v in changes.values()):  # the server restarted: skip its interval
                continue
            reported = True
            for key, value in changes.items():
                delta[key] += value
        self._at_collect = {url: dict(c) for url, c in self._latest.items()}
        self._collected = now
        return _rates(delta, elapsed) if reported else {}


def _rates(delta: dict[str, float], elapsed: float) -> dict[str, float]:
    out = {
        "server/prompt_tokens_per_s": delta["prompt_tokens"] / elapsed,
        "server/generated_tokens_per_s": delta["generated_tokens"] / elapsed,
    }
    if delta["prefix_cache_queries"] > 0:
        out["server/prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
    if delta["prefill_requests"] > 0:
        out["server/prefill_s_mean"] = delta["prefill_s"] / delta["prefill_requests"]
    if delta["decode_requests"] > 0:
        out["server/decode_s_mean"] = delta["decode_s"] / delta["decode_requests"]
    return out


__all__ = ["COUNTERS", "CountingClient", "ServerStats", "parse_prometheus"]
