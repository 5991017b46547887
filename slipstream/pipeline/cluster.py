"""What the controller's parts need from a cluster, and the Ray implementation.

The launcher, the step driver, the supervisor and the checkpoint coordinator start actors, call their
methods, wait for answers, kill them and ask whether their node is still there; nothing else. Behind this
interface those four know nothing of Ray, so the supervisor's restart policy is tested with a fake
cluster (``tests/pipeline/fake_cluster.py``) without processes, sockets or sleeps.

A call returns a handle at once (Ray: an ``ObjectRef``); :meth:`Cluster.get` waits for its value and
turns every way a call can fail into one of three errors, so no caller catches a Ray exception:

* :class:`ActorDied`: the actor is gone (crashed, killed, its node lost, killed by Ray's memory monitor);
* :class:`CallTimedOut`: no answer within the timeout;
* :class:`CallFailed`: the method raised; ``cause`` is its exception.

:func:`ask` wraps ``get`` for callers that end the run on any of them, with a :class:`PartFailed` naming
the part and, when Ray lost nodes of the run, which ones and what they held.

Worked example::

    cluster = RayCluster(placement)
    rank = cluster.spawn("rank0", TrainerRank, settings, 0, 1, run_dir, 1, max_concurrency=2)
    host, port = ask(cluster, cluster.call(rank, "endpoint"), 60.0, "trainer rank 0")
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

# Seconds a quick control call (status, metrics, set_version, stop ...) may take.
CALL_TIMEOUT_S = 60.0


class PartFailed(RuntimeError):
    """A part of the run died or stopped answering; the message names the part and what happened."""


class ActorDied(Exception):
    """The actor behind a call is gone."""


class CallTimedOut(Exception):
    """A call had no answer within its timeout."""


class CallFailed(Exception):
    """The called method raised ``cause``."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class TrainerDied(Exception):
    """A trainer rank died (the step loop restarts every rank or fails the run)."""


class Cluster(ABC):
    """Actors placed by part name (``queue``, ``rollouter``, ``server<i>``, ``rank<i>``)."""

    @abstractmethod
    def spawn(self, part: str, cls: type, *args: Any, **options: Any) -> Any:
        """Start ``cls(*args)`` as an actor in the place reserved for ``part``; return its handle.
        ``options`` are per-actor settings (``max_concurrency``)."""

    @abstractmethod
    def call(self, actor: Any, method: str, *args: Any) -> Any:
        """Start ``actor.method(*args)``; return a handle for :meth:`get` / :meth:`wait`."""

    @abstractmethod
    def get(self, calls: Any, timeout_s: float) -> Any:
        """The value of one call, or the list of values of a list of calls; raises :class:`ActorDied`,
        :class:`CallTimedOut` or :class:`CallFailed`."""

    @abstractmethod
    def wait(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        """(finished, pending) once every call finished or ``timeout_s`` passed (0: look, do not wait)."""

    @abstractmethod
    def kill(self, actor: Any) -> None:
        """End the actor now, without its clean-up (a dead one is no error)."""

    def done(self, call: Any) -> bool:
        return bool(self.wait([call], 0.0)[0])

    def has_room(self, part: str) -> bool:
        """Whether ``part``'s reserved place exists now (False after its node died until one replaces it)."""
        return True

    def demand(self, part: str) -> dict[str, float]:
        return {}

    def lost_nodes(self) -> dict[str, list[str]]:
        """Node -> the run's parts it held, for every node of the run the cluster lost."""
        return {}

    @abstractmethod
    def release(self) -> None:
        """Give back what the run reserved (at shutdown)."""


def ask(cluster: Cluster, calls: Any, timeout_s: float, what: str) -> Any:
    """``cluster.get`` for callers that end the run when a part fails: a :class:`PartFailed` naming ``what``."""
    try:
        return cluster.get(calls, timeout_s)
    except CallTimedOut as err:
        raise PartFailed(f"{what}: no answer within {timeout_s:.0f} s") from err
    except ActorDied as err:
        raise PartFailed(f"{what} died: {first_line(err)}{lost_note(cluster)}") from err
    except CallFailed as err:
        raise PartFailed(f"{what} failed: {err.cause if err.cause is not None else err}") from err


def call_ranks(cluster: Cluster, ranks: list[Any], method: str, timeout_s: float, *args: Any) -> list[Any]:
    """Call ``method`` on every trainer rank at once (they run collectives together); a dead rank is a
    :class:`TrainerDied`, a hang or an error a :class:`PartFailed`."""
    calls = [cluster.call(rank, method, *args) for rank in ranks]
    try:
        return cluster.get(calls, timeout_s)
    except ActorDied as err:
        raise TrainerDied(f"a trainer rank died during {method}: {first_line(err)}") from err
    except CallTimedOut as err:
        raise PartFailed(f"trainer {method} did not finish within {timeout_s:.0f} s") from err
    except CallFailed as err:
        raise PartFailed(f"trainer {method} failed: {err.cause if err.cause is not None else err}") from err


def lost_note(cluster: Cluster) -> str:
    """``. Lost: node X (holding a, b) ...`` for every node of the run the cluster lost, else empty."""
    lost = cluster.lost_nodes()
    if not lost:
        return ""
    nodes = "; ".join(f"node {node} (holding {', '.join(parts)})" for node, parts in lost.items())
    return (
        f". Lost: {nodes}. Start a replacement node (scripts/launch_*_cluster.sh) and run the same command "
        "again: run.resume continues from the latest checkpoint"
    )


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class RayCluster(Cluster):
    """Actors in the run's placement groups (``pipeline/placement.py``); the placement may be None for
    callers that place nothing (then actors take Ray's defaults)."""

    def __init__(self, placement: Any = None) -> None:
        self.placement = placement

    def spawn(self, part: str, cls: type, *args: Any, **options: Any) -> Any:
        import ray

        opts = self.placement.options(part, **options) if self.placement is not None else options
        return ray.remote(cls).options(**opts).remote(*args)

    def call(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).remote(*args)

    def get(self, calls: Any, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(calls, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise CallTimedOut(str(err)) from err
        # OutOfMemoryError: Ray's memory monitor killed the actor's worker (it is no RayActorError).
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as err:
            raise ActorDied(first_line(err)) from err
        except ray.exceptions.RayTaskError as err:
            raise CallFailed(str(err), err.cause) from err

    def wait(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        import ray

        if not calls:
            return [], []
        return ray.wait(calls, num_returns=len(calls), timeout=timeout_s)

    def kill(self, actor: Any) -> None:
        import ray

        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass

    def has_room(self, part: str) -> bool:
        return self.placement is None or self.placement.has_room(part)

    def demand(self, part: str) -> dict[str, float]:
        return dict(self.placement.parts[part].demand) if self.placement is not None else {}

    def lost_nodes(self) -> dict[str, list[str]]:
        return self.placement.lost_nodes() if self.placement is not None else {}

    def release(self) -> None:
        if self.placement is not None:
            self.placement.release()


__all__ = [
    "CALL_TIMEOUT_S",
    "ActorDied",
    "CallFailed",
    "CallTimedOut",
    "Cluster",
    "PartFailed",
    "RayCluster",
    "TrainerDied",
    "ask",
    "call_ranks",
    "lost_note",
]
