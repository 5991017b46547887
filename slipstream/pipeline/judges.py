"""Health and restarts of the judge servers the run started (``reward.service.launch``).

The same policy as the rollout servers' (``supervisor.py``), without their weights: a judge server whose
process exits, whose host actor dies, or whose ``/health`` fails ``cluster.unhealthy_checks`` checks in a row
is, with ``cluster.restart_servers`` and at most ``cluster.max_restarts`` times, taken out of the reward
service's URLs, started again (a new host actor when the old one died) and put back with its new URL. No
push and no catch-up: a judge serves its own model's weights, version 0, for the whole run. Otherwise the
run fails with a :class:`PartFailed` naming it and its last output.

While a judge restarts, the reward service sends its requests to the other judges; with none left it keeps
the dead one's URL, so its requests are retried (``reward.service.retries``, with backoff) and samples that
still fail score ``reward.service.failure_score`` with the reason: the run goes on either way.

States of a judge server: ``serving --(dies)--> restarting --(start done)--> serving``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from slipstream.config import Config
from slipstream.pipeline.cluster import CALL_TIMEOUT_S, Cluster, PartFailed, ask
from slipstream.pipeline.health import count_restart, death_of
from slipstream.pipeline.launcher import Launcher, Parts
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class JudgeWatch:
    """Checks the judge servers and restarts dead ones (module docstring). ``restarts`` is the supervisor's
    count per part, here ``judge-<i>``."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        parts: Parts,
        launcher: Launcher,
        restarts: dict[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.cluster, self.parts, self.launcher = cfg, cluster, parts, launcher
        self.restarts = restarts
        self.clock = clock
        self._restarting: dict[int, Any] = {}  # judge index -> the call of its start()
        self._unhealthy: dict[int, int] = {}

    @property
    def restarting(self) -> set[int]:
        return set(self._restarting)

    def check(self) -> None:
        """One health check of every judge server not being restarted."""
        for index in range(len(self.parts.judge_hosts)):
            if index not in self._restarting:
                self._check(index)

    def progress(self) -> None:
        """Judges whose restart finished serve again."""
        for index, call in list(self._restarting.items()):
            if not self.cluster.done(call):
                continue
            del self._restarting[index]
            try:
                url = self.cluster.get(call, CALL_TIMEOUT_S)
            except Exception as err:
                raise PartFailed(f"judge server {index} could not be restarted: {err}") from err
            self.parts.judge_urls[index] = url
            self._hand_over()
            log.info("judge server %d is back at %s", index, url)

    def _check(self, index: int) -> None:
        limit = self.cfg.cluster.unhealthy_checks
        death = death_of(self.cluster, self.parts.judge_hosts[index], self._unhealthy, index, limit)
        if death is not None:
            self._died(index, death[0], replace_host=death[1])

    def _died(self, index: int, reason: str, *, replace_host: bool = False) -> None:
        url, key = self.parts.judge_urls[index], f"judge-{index}"

        def last_output() -> str:
            return "" if replace_host else self._ask(self.parts.judge_hosts[index], "log_tail", what=key)

        count = count_restart(
            self.cfg.cluster, self.restarts, key, f"judge server {index} ({url})", reason, last_output
        )
        log.warning("judge server %d (%s) died: %s; restarting it (%d/%d)", index, url, reason, count,
                    self.cfg.cluster.max_restarts)  # fmt: skip
        self._unhealthy.pop(index, None)
        self._restarting[index] = None  # out of the reward service's URLs from now on
        self._hand_over()
        if replace_host:
            self.cluster.kill(self.parts.judge_hosts[index])
            self.parts.judge_hosts[index] = self.launcher.new_judge_host(index)
        self._restarting[index] = self.cluster.call(self.parts.judge_hosts[index], "start")

    def _hand_over(self) -> None:
        """The reward service gets the URLs of the judges serving (all of them when none is)."""
        urls = [u for i, u in enumerate(self.parts.judge_urls) if i not in self._restarting]
        urls = urls or list(self.parts.judge_urls)
        self._ask(self.parts.rollouter, "set_judge_urls", urls, what="rollouter")

    def _ask(self, actor: Any, method: str, *args: Any, what: str) -> Any:
        return ask(self.cluster, self.cluster.call(actor, method, *args), CALL_TIMEOUT_S, what)


__all__ = ["JudgeWatch"]
