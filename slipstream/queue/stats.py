"""Per-partition counters behind ``QueueClient.stats()``: totals, windowed rates, the staleness histogram."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from slipstream.queue.protocol import PartitionStats


class _Rate:
    """Events per second over the last ``window`` seconds, in one-second buckets (O(1) per event)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._buckets: deque[list[int]] = deque()  # [second, count]
        self._start = time.monotonic()

    def add(self, n: int = 1) -> None:
        sec = int(time.monotonic())
        if self._buckets and self._buckets[-1][0] == sec:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([sec, n])
            self._trim(sec)

    def _trim(self, sec: int) -> None:
        while self._buckets and self._buckets[0][0] <= sec - self.window:
            self._buckets.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        self._trim(int(now))
        span = min(self.window, max(now - self._start, 1e-3))
        return sum(c for _, c in self._buckets) / span


@dataclass
class PartitionCounters:
    WINDOW_S = 30.0

    put_total: int = 0
    put_bytes_total: int = 0
    leased_total: int = 0
    acked_total: int = 0
    dropped_total: int = 0
    nacked_total: int = 0
    expired_total: int = 0
    duplicates_total: int = 0
    quarantined_total: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    _puts: _Rate = field(default_factory=lambda: _Rate(PartitionCounters.WINDOW_S))
    _leases: _Rate = field(default_factory=lambda: _Rate(PartitionCounters.WINDOW_S))
    _acks: _Rate = field(default_factory=lambda: _Rate(PartitionCounters.WINDOW_S))

    def on_put(self, nbytes: int) -> None:
        self.put_total += 1
        self.put_bytes_total += nbytes
        self._puts.add()

    def on_lease(self, group, consumer_version: int | None) -> None:
        self.leased_total += 1
        self._leases.add()
        if consumer_version is not None:
            lag = consumer_version - min(s.min_version for s in group.meta.samples)
            self.staleness[lag] = self.staleness.get(lag, 0) + 1

    def on_ack(self, dropped: bool) -> None:
        self.acked_total += 1
        self.dropped_total += dropped
        self._acks.add()

    def snapshot(
        self, ready_groups: int, ready_bytes: int, leased_groups: int, leased_bytes: int
    ) -> PartitionStats:
        return PartitionStats(
            ready_groups=ready_groups,
            ready_bytes=ready_bytes,
            leased_groups=leased_groups,
            leased_bytes=leased_bytes,
            put_total=self.put_total,
            put_bytes_total=self.put_bytes_total,
            leased_total=self.leased_total,
            acked_total=self.acked_total,
            dropped_total=self.dropped_total,
            nacked_total=self.nacked_total,
            expired_total=self.expired_total,
            duplicates_total=self.duplicates_total,
            quarantined_total=self.quarantined_total,
            put_rate=self._puts.rate(),
            lease_rate=self._leases.rate(),
            ack_rate=self._acks.rate(),
            staleness=dict(sorted(self.staleness.items())),
        )
