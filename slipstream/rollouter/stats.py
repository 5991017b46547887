"""Rollouter metrics over a window: from one :meth:`RolloutStats.collect` call to the next.

The controller logs the rollouter's metrics once per trainer step, so rates and distributions describe
that step's window (not the whole run): tokens/s, the idle ratio (share of the window with no request in
flight: the servers waited on the rollouter), staleness of the trajectories put, in weight versions (pushes
between the oldest of a trajectory's tokens and the latest version at put time, the unit of
``async.max_staleness``), the share of partial trajectories (resumed
after an abort, or spanning more than one version), reward statistics and reward errors. Counters
(groups put, dropped, failed...) are totals since the start.

Keys (all under ``rollouter/``): requests_active, requests_queued, groups_in_flight, gate_admitted,
gate_budget, version, generated_tokens_per_s, idle_ratio, trajectories, staleness_versions_{mean,p50,max},
version_span_mean, partial_ratio, reward_{mean,std,min,max}, reward_errors, response_len_mean,
num_turns_mean, finish_{stop,length,abort}, filter_ratio (share of the window's finished groups that
dynamic sampling dropped), and the totals groups_put, groups_duplicate, groups_dropped, groups_failed,
prompts_skipped, filtered_groups, prompts_filtered_out, stale_kept_groups.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

from slipstream.utils.versions import versions_behind

TOTALS = (
    "groups_put",
    "groups_duplicate",
    "groups_dropped",
    "groups_failed",
    "prompts_skipped",
    "filtered_groups",
    "prompts_filtered_out",
    "stale_kept_groups",
)


class RolloutStats:
    """Accumulates per-trajectory records and turns them into the metrics dict, one window at a time."""

    def __init__(self, sync_every: int = 1) -> None:
        self.sync_every = sync_every  # versions are trainer steps; one push every sync_every of them
        self.totals: Counter[str] = Counter()
        self._reset(time.monotonic(), tokens=0, busy_s=0.0)

    def _reset(self, now: float, *, tokens: int, busy_s: float) -> None:
        self._t0, self._tokens0, self._busy0 = now, tokens, busy_s
        self._staleness: list[int] = []
        self._spans: list[int] = []
        self._partial = 0
        self._rewards: list[float] = []
        self._reward_errors = 0
        self._lengths: list[int] = []
        self._turns: list[int] = []
        self._finish: Counter[str] = Counter()
        self._groups = 0
        self._groups_filtered = 0

    def count(self, name: str, n: int = 1) -> None:
        self.totals[name] += n

    def record_group(self, *, filtered: bool) -> None:
        """A group finished generating; ``filtered`` when dynamic sampling dropped it."""
        self._groups += 1
        self._groups_filtered += int(filtered)

    def record_trajectory(
        self,
        *,
        versions: list[int],
        current_version: int,
        num_resumes: int,
        reward: float,
        reward_error: bool,
        response_len: int,
        num_turns: int,
        finish_reason: str,
    ) -> None:
        if versions:
            self._staleness.append(versions_behind(current_version, min(versions), self.sync_every))
            self._spans.append(max(versions) - min(versions))
        self._partial += int(num_resumes > 0 or (bool(versions) and max(versions) != min(versions)))
        self._rewards.append(reward)
        self._reward_errors += int(reward_error)
        self._lengths.append(response_len)
        self._turns.append(num_turns)
        self._finish[finish_reason] += 1

    def collect(self, *, tokens: int, busy_s: float, gauges: dict[str, float]) -> dict[str, float]:
        """The window's metrics plus ``gauges``; starts the next window. ``tokens`` and ``busy_s`` are the
        running totals of generated tokens and busy seconds."""
        now = time.monotonic()
        elapsed = max(now - self._t0, 1e-9)
        n = len(self._rewards)
        out: dict[str, float] = {f"rollouter/{k}": float(v) for k, v in gauges.items()}
        out["rollouter/generated_tokens_per_s"] = (tokens - self._tokens0) / elapsed
        out["rollouter/idle_ratio"] = min(1.0, max(0.0, 1.0 - (busy_s - self._busy0) / elapsed))
        out["rollouter/trajectories"] = float(n)
        if self._staleness:
            out["rollouter/staleness_versions_mean"] = statistics.fmean(self._staleness)
            out["rollouter/staleness_versions_p50"] = float(statistics.median(self._staleness))
            out["rollouter/staleness_versions_max"] = float(max(self._staleness))
            out["rollouter/version_span_mean"] = statistics.fmean(self._spans)
        if n:
            out["rollouter/partial_ratio"] = self._partial / n
            out["rollouter/reward_mean"] = statistics.fmean(self._rewards)
            out["rollouter/reward_std"] = statistics.pstdev(self._rewards)
            out["rollouter/reward_min"] = min(self._rewards)
            out["rollouter/reward_max"] = max(self._rewards)
            out["rollouter/reward_errors"] = float(self._reward_errors)
            out["rollouter/response_len_mean"] = statistics.fmean(self._lengths)
            out["rollouter/num_turns_mean"] = statistics.fmean(self._turns)
            for reason in ("stop", "length", "abort"):
                out[f"rollouter/finish_{reason}"] = self._finish[reason] / n
        if self._groups:
            out["rollouter/filter_ratio"] = self._groups_filtered / self._groups
        for name in TOTALS:
            out[f"rollouter/{name}"] = float(self.totals[name])
        self._reset(now, tokens=tokens, busy_s=busy_s)
        return out
