"""The rule a server host lives or dies by, and the restart flow, shared by rollout servers
(``supervisor.py``) and judge servers (``judges.py``).

A server counts as dead when its host actor died, when its process exited, or when ``/health`` failed
``cluster.unhealthy_checks`` checks in a row; a dead server may restart while ``cluster.restart_servers`` is on
and it has restarted fewer than ``cluster.max_restarts`` times, else the run fails naming it with its last
output. :class:`HostPool` is that flow, written once: check every host, count a death, replace a dead host
actor, start the server again, and hand back each finished restart with its new URL. What happens around it
differs per kind and stays with the caller: a rollout server leaves the balancer and the publisher first and
is caught up with the current weights after; a judge server leaves the reward service's URLs and is handed
back as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.config import ClusterConfig
from slipstream.pipeline.cluster import CALL_TIMEOUT_S, ActorDied, Cluster, PartFailed, Pending
from slipstream.pipeline.handles import ServerHandle
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


def death_of(
    host: ServerHandle, unhealthy: dict[int, int], index: int, limit: int
) -> tuple[str, bool] | None:
    """Why server ``index`` (behind ``host``) counts as dead, and whether its host actor died; None while it
    lives. ``unhealthy`` counts each server's failed /health checks in a row (updated here)."""
    try:
        health = host.health()
    except ActorDied:
        return "its host actor died", True
    if not health.alive:
        return f"its process exited with code {health.returncode}", False
    if health.healthy:
        unhealthy.pop(index, None)
        return None
    unhealthy[index] = unhealthy.get(index, 0) + 1
    if unhealthy[index] >= limit:
        return f"/health failed {unhealthy[index]} checks in a row", False
    return None


def count_restart(
    c: ClusterConfig,
    restarts: dict[str, int],
    key: str,
    what: str,
    reason: str,
    last_output: Callable[[], str],
) -> int:
    """Count one more restart of ``key`` (``what``: "inference server 0 (http://...)") and return the count;
    raise :class:`PartFailed` with ``reason`` and the server's last output when no restart is allowed."""
    count = restarts.get(key, 0)
    if not c.restart_servers or count >= c.max_restarts:
        why = "cluster.restart_servers is off" if count == 0 else "cluster.max_restarts used up"
        raise PartFailed(f"{what} died: {reason}; not restarted ({why}). Its last output:\n{last_output()}")
    restarts[key] = count + 1
    return count + 1


class HostPool:
    """The servers of one kind (``label``: "inference server", "judge server"; ``key``: ``server``,
    ``judge``, as in the ``restarts`` counts ``<key>-<i>``) and their restarts. ``hosts()`` and ``urls()`` give
    the run's current lists (``Parts.servers``/``urls`` or ``Parts.judges``/``judge_urls``: read at every use,
    since the launcher fills them after the pool is built), updated in place; ``new_host(i)`` makes a fresh
    host actor for server ``i`` when the old one died.

    Lifecycle of one server: ``deaths()`` names it dead -> the caller detaches it -> ``restart(i, ...)``
    (counts, or raises PartFailed) -> ``finished()`` hands back ``(i, url)`` once it serves again."""

    def __init__(
        self,
        c: ClusterConfig,
        cluster: Cluster,
        label: str,
        key: str,
        hosts: Callable[[], list[ServerHandle]],
        urls: Callable[[], list[str]],
        new_host: Callable[[int], ServerHandle],
        restarts: dict[str, int],
    ) -> None:
        self.c, self.cluster = c, cluster
        self.label, self.key = label, key
        self._hosts, self._urls = hosts, urls
        self.new_host = new_host
        self.restarts = restarts
        self.starting: dict[int, Pending[str] | None] = {}  # index -> the call of its start()
        self._unhealthy: dict[int, int] = {}

    @property
    def restarting(self) -> set[int]:
        return set(self.starting)

    def deaths(self) -> list[tuple[int, str, bool]]:
        """One health check of every server not restarting: ``(index, reason, host actor died)`` for the dead."""
        found = []
        hosts = self._hosts()
        for index in range(len(hosts)):
            if index in self.starting:
                continue
            death = death_of(hosts[index], self._unhealthy, index, self.c.unhealthy_checks)
            if death is not None:
                found.append((index, *death))
        return found

    def count(self, index: int, reason: str, replace_host: bool) -> None:
        """Count a restart of server ``index``, or raise PartFailed with its last output when none is allowed;
        it counts as restarting from now on."""
        url, key = self._urls()[index], f"{self.key}-{index}"

        def last_output() -> str:
            return "" if replace_host else self._hosts()[index].log_tail()

        what = f"{self.label} {index} ({url})"
        n = count_restart(self.c, self.restarts, key, what, reason, last_output)
        log.warning("%s died: %s; restarting it (%d/%d)", what, reason, n, self.c.max_restarts)
        self._unhealthy.pop(index, None)
        self.starting[index] = None

    def restart(self, index: int, replace_host: bool) -> None:
        """Start server ``index`` again (on a new host actor when the old one died)."""
        hosts = self._hosts()
        if replace_host:
            self.cluster.kill(hosts[index].actor)
            hosts[index] = self.new_host(index)
        self.starting[index] = hosts[index].start()

    def finished(self) -> list[tuple[int, str]]:
        """Servers whose restart finished, with their new URLs (written into ``urls`` too)."""
        done = []
        for index, call in list(self.starting.items()):
            if call is None or not self.cluster.done(call):
                continue
            del self.starting[index]
            try:
                url = self.cluster.get(call, CALL_TIMEOUT_S)
            except Exception as err:
                raise PartFailed(f"{self.label} {index} could not be restarted: {err}") from err
            self._urls()[index] = url
            done.append((index, url))
        return done
