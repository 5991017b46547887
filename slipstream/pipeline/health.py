"""The rule a server host lives or dies by, shared by rollout servers (``supervisor.py``) and judge servers
(``judges.py``): what counts as dead, and whether a death may be answered with a restart.

A server counts as dead when its host actor died, when its process exited, or when ``/health`` failed
``cluster.unhealthy_checks`` checks in a row; a dead server may restart while ``cluster.restart_servers`` is on
and it has restarted fewer than ``cluster.max_restarts`` times, else the run fails naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.config import ClusterConfig
from slipstream.pipeline.cluster import CALL_TIMEOUT_S, ActorDied, Cluster, PartFailed
from slipstream.pipeline.types import ServerHealth


def death_of(
    cluster: Cluster, host: Any, unhealthy: dict[int, int], index: int, limit: int
) -> tuple[str, bool] | None:
    """Why server ``index`` (behind ``host``) counts as dead, and whether its host actor died; None while it
    lives. ``unhealthy`` counts each server's failed /health checks in a row (updated here)."""
    try:
        health: ServerHealth = cluster.get(cluster.call(host, "health"), CALL_TIMEOUT_S)
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
