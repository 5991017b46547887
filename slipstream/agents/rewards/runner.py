"""Scoring responses off the event loop: a process pool with a timeout per call, and failures as data.

A reward function may be slow (sympy), hang (a pathological expression), raise, or even kill its
process. None of that may stall or crash the rollouter, whose event loop drives hundreds of requests.
So every call runs in a worker process of a ``concurrent.futures.ProcessPoolExecutor`` (spawned, so no
state of the rollouter is inherited), at most ``num_workers`` at a time so a call's timeout measures its
own run time rather than time spent queued, and

* an exception in the function scores 0 with ``error`` set to the exception's text;
* a call over ``timeout_s`` scores 0 with ``error = "timeout"``; the pool is replaced and its workers
  killed (a hung call cannot be cancelled any other way); calls that were running beside it in the old
  pool are retried once on the new one, since they were not at fault;
* a worker that dies (segfault, out of memory) breaks the pool the same way and is handled alike.

Data sources mapped to ``service`` skip the pool: a served judge or reward model scores them
(:class:`~slipstream.agents.rewards.service.RewardService`, with its own timeouts and retries).

``concurrent.futures`` has no public way to kill the workers of a pool before Python 3.14
(``terminate_workers``), so :func:`_kill_workers` reads the executor's ``_processes`` table.

Worked example::

    runner = RewardRunner(RewardConfig(num_workers=2, timeout_s=5.0))
    result = await runner.score("arithmetic", "It is 7", "7", {})   # RewardResult(score=1.0, ...)
    runner.close()
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from slipstream.agents.config import RewardConfig
from slipstream.agents.rewards import SERVICE_REWARD, resolve, reward_name
from slipstream.agents.rewards.result import RewardResult, normalise
from slipstream.agents.rewards.service import RewardService
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


def _worker_init() -> None:
    # Reward functions are single-threaded; keep libraries from starting a thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _score_in_worker(
    name: str, response: str, ground_truth: Any, extra_info: dict[str, Any]
) -> tuple[float, dict[str, float], str]:
    """Runs in a worker: call the function and turn any exception into text (exceptions of user code may
    not survive the trip back)."""
    try:
        value = resolve(name)(response, ground_truth, extra_info)
        return (*normalise(value), "")
    except Exception as err:  # a reward function's failure is data, never a crash
        return 0.0, {}, f"{type(err).__name__}: {err}"[:500]


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


class RewardRunner:
    """Scores responses in worker processes; see the module docstring for the failure rules.

    Lifecycle: create (no process starts until the first call), ``await score(...)`` from any task of
    one event loop, ``close()`` at the end. ``check(data_sources)`` fails fast on a data source with no
    reward function, before a run spends time generating for it.
    """

    def __init__(self, cfg: RewardConfig | None = None, *, sources: Mapping[str, str] | None = None):
        self.cfg = cfg or RewardConfig()
        self.sources = dict(self.cfg.sources if sources is None else sources)
        self._pool: ProcessPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        # Data sources mapped to `service` are scored by reward.service's servers, not by the pool.
        self.service = RewardService(self.cfg.service)
        self.calls = 0
        self.errors = 0
        self.timeouts = 0

    def check(self, data_sources: Iterable[str]) -> None:
        """Raise KeyError naming the first data source that has no reward function."""
        for source in sorted(set(data_sources)):
            if reward_name(source, self.sources) == SERVICE_REWARD:
                if not self.cfg.service.urls:
                    started = " (the servers of reward.service.launch are started by `slipstream train`)"
                    raise KeyError(
                        f"data source `{source}` is scored by `service`, but reward.service.urls is empty"
                        + (started if self.cfg.service.launch.model_path else "")
                    )
                continue
            resolve(source, self.sources)

    def _current_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.cfg.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
            )
        return self._pool

    def _replace_pool(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is broken:
            self._pool = None
        _kill_workers(broken)

    async def score(
        self, data_source: str, response: str, ground_truth: Any, extra_info: dict[str, Any]
    ) -> RewardResult:
        """Score one response; never raises for a failing reward function (see :class:`RewardResult`)."""
        try:
            name = reward_name(data_source, self.sources)
        except KeyError as err:
            return self._failed(str(err.args[0]))
        if name == SERVICE_REWARD:
            self.calls += 1
            try:  # reward.timeout_s bounds the whole call (queueing, retries), as it bounds a function's
                result = await asyncio.wait_for(
                    self.service.score(response, ground_truth, extra_info), self.cfg.timeout_s
                )
            except TimeoutError:
                self.timeouts += 1
                self.errors += 1
                error = f"reward service: no score within reward.timeout_s={self.cfg.timeout_s:g}"
                return RewardResult(score=self.cfg.service.failure_score, error=error)
            self.errors += bool(result.error)
            return result
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.cfg.num_workers)
        self.calls += 1
        async with self._slots:
            for attempt in range(2):
                pool = self._current_pool()
                future = pool.submit(_score_in_worker, name, response, ground_truth, extra_info)
                try:
                    score, components, error = await asyncio.wait_for(
                        asyncio.wrap_future(future), self.cfg.timeout_s
                    )
                except TimeoutError:
                    self.timeouts += 1
                    log.warning("reward `%s` took over %.1fs; scored 0", name, self.cfg.timeout_s)
                    self._replace_pool(pool)
                    return self._failed("timeout")
                except BrokenProcessPool:
                    self._replace_pool(pool)
                    if attempt == 0:
                        continue
                    return self._failed("worker died")
                if error:
                    return self._failed(error)
                return RewardResult(score=score, components=components)
        return self._failed("worker died")  # unreachable: the loop always returns

    def _failed(self, error: str) -> RewardResult:
        self.errors += 1
        return RewardResult(score=0.0, error=error)

    def close(self) -> None:
        self.service.close()
        if self._pool is not None:
            _kill_workers(self._pool)
            self._pool = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
