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

from slipstream.config import Config
from slipstream.pipeline.cluster import Cluster
from slipstream.pipeline.health import HostPool
from slipstream.pipeline.launcher import Launcher
from slipstream.pipeline.parts import Parts
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class JudgeWatch:
    """Checks the judge servers and restarts dead ones (module docstring) through the restart flow shared
    with the rollout servers (``health.HostPool``). ``restarts`` is the supervisor's count per part, here
    ``judge-<i>``."""

    def __init__(
        self, cfg: Config, cluster: Cluster, parts: Parts, launcher: Launcher, restarts: dict[str, int]
    ) -> None:
        self.parts = parts
        self.pool = HostPool(
            cfg.cluster, cluster, "judge server", "judge", parts.judges, launcher.new_judge_host, restarts
        )

    @property
    def restarting(self) -> set[int]:
        return self.pool.restarting

    def check(self) -> None:
        """One health check of every judge server not being restarted."""
        for index, reason, replace_host in self.pool.deaths():
            self.pool.count(index, reason, replace_host)
            self._hand_over()  # out of the reward service's URLs from now on
            self.pool.restart(index, replace_host)

    def progress(self) -> None:
        """Judges whose restart finished serve again."""
        for index, url in self.pool.finished():
            self._hand_over()
            log.info("judge server %d is back at %s", index, url)

    def _hand_over(self) -> None:
        """The reward service gets the URLs of the judges serving (all of them when none is)."""
        judges = self.parts.judges
        self.parts.rollouter.set_judge_urls(judges.live_urls() or judges.urls)


__all__ = ["JudgeWatch"]
