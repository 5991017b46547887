"""The rule a server host lives or dies by, and the restart flow, shared by rollout servers
(``supervisor.py``) and judge servers (``judges.py``).

A server counts as dead when its host actor died, when its process exited, or when ``/health`` failed
``cluster.unhealthy_checks`` checks in a row; a dead server may restart while ``cluster.restart_servers`` is on
and it has restarted fewer than ``cluster.max_restarts`` times, else the run fails naming it with its last
output. :class:`HostPool` is that flow, written once over a :class:`~slipstream.pipeline.parts.ServerPool`
(which it writes only through the pool's methods): check every host, count a death and mark the server
down, replace a dead host actor, start the server again, and hand back each finished restart with its new
URL, recorded in the pool. What happens around it
differs per kind and stays with the caller: a rollout server leaves the balancer and the publisher first and
is caught up with the current weights after; a judge server leaves the reward service's URLs and is handed
back as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.config import ClusterConfig
from slipstream.pipeline.cluster import CALL_TIMEOUT_S, ActorDied, Cluster, PartFailed, Pending
from slipstream.pipeline.handles import ServerHandle
from slipstream.pipeline.parts import ServerPool
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
    """The restarts of the servers of one ``pool`` (``label``: "inference server", "judge server"; ``key``:
    ``server``, ``judge``, as in the ``restarts`` counts ``<key>-<i>``). The pool is read at every use (the
    launcher fills it after this is built); ``new_host(i)`` makes a fresh host actor for server ``i`` when the
    old one died. Servers given by URL (no host) are never checked.

    Lifecycle of one server: ``deaths()`` names it dead -> ``count(i, ...)`` (counts and marks it down, or
    raises PartFailed) -> the caller detaches it -> ``restart(i, ...)`` -> ``finished()`` hands back
    ``(i, url)`` once it serves again (the pool has the URL and the server up again)."""

    def __init__(
        self,
        c: ClusterConfig,
        cluster: Cluster,
        label: str,
        key: str,
        pool: ServerPool,
        new_host: Callable[[int], ServerHandle],
        restarts: dict[str, int],
    ) -> None:
        self.c, self.cluster = c, cluster
        self.label, self.key = label, key
        self.pool = pool
        self.new_host = new_host
        self.restarts = restarts
        self._starts: dict[int, Pending[str]] = {}  # index -> the call of its start(), while it restarts
        self._unhealthy: dict[int, int] = {}

    @property
    def restarting(self) -> set[int]:
        return self.pool.down

    def deaths(self) -> list[tuple[int, str, bool]]:
        """One health check of every server not restarting: ``(index, reason, host actor died)`` for the dead."""
        found = []
        for index, slot in enumerate(self.pool):
            if slot.down or slot.handle is None:
                continue
            death = death_of(slot.handle, self._unhealthy, index, self.c.unhealthy_checks)
            if death is not None:
                found.append((index, *death))
        return found

    def count(self, index: int, reason: str, replace_host: bool) -> None:
        """Count a restart of server ``index``, or raise PartFailed with its last output when none is allowed;
        it is down from now on."""
        slot, key = self.pool[index], f"{self.key}-{index}"

        def last_output() -> str:
            return "" if replace_host or slot.handle is None else slot.handle.log_tail()

        what = f"{self.label} {index} ({slot.url})"
        n = count_restart(self.c, self.restarts, key, what, reason, last_output)
        log.warning("%s died: %s; restarting it (%d/%d)", what, reason, n, self.c.max_restarts)
        self._unhealthy.pop(index, None)
        self.pool.mark_down(index)

    def restart(self, index: int, replace_host: bool) -> None:
        """Start server ``index`` again (on a new host actor when the old one died)."""
        host = self.pool[index].handle
        assert host is not None, "a server given by URL is never restarted"
        if replace_host:
            self.cluster.kill(host.actor)
            host = self.new_host(index)
            self.pool.replace_host(index, host)
        self._starts[index] = host.start()

    def finished(self) -> list[tuple[int, str]]:
        """Servers whose restart finished, with their new URLs (the pool has them serving there)."""
        done = []
        for index, call in list(self._starts.items()):
            if not self.cluster.done(call):
                continue
            del self._starts[index]
            try:
                url = self.cluster.get(call, CALL_TIMEOUT_S)
            except Exception as err:
                raise PartFailed(f"{self.label} {index} could not be restarted: {err}") from err
            self.pool.serving(index, url)
            done.append((index, url))
        return done
