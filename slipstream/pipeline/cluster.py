"""What the controller's parts need from a cluster, and the Ray implementation.

The launcher, the step driver, the supervisor and the checkpoint coordinator start actors, call their
methods, wait for answers, kill them and ask whether their node is still there; nothing else. Behind this
interface those four know nothing of Ray, so the supervisor's restart policy is tested with a fake
cluster (``tests/pipeline/fake_cluster.py``) without processes, sockets or sleeps.

A call names the actor class's own method, never a string (``cluster.call(actor, TrainerRank.step)``): a
misspelt method fails at import, a type checker checks the arguments against the method's signature
(``ParamSpec``) and types the result, and a reader can follow a call to its method. The controller's parts do
not call this directly either: each role has a typed handle (``pipeline/handles.py``: ``TrainerGroup``,
``RolloutHandle``, ``ServerHandle``, ``QueueHandle``) with one method per operation. The Ray
implementation dispatches by the method's ``__name__``, the one place a name is looked up (vLLM's
``core_client.py`` keeps its string RPC the same way, behind typed methods).

A call returns a :class:`Pending` at once (Ray: an ``ObjectRef`` inside); :meth:`Cluster.get` waits for its
value and turns every way a call can fail into one of three errors, so no caller catches a Ray exception:

* :class:`ActorDied`: the actor is gone (crashed, killed, its node lost, killed by Ray's memory monitor);
* :class:`CallTimedOut`: no answer within the timeout;
* :class:`CallFailed`: the method raised; ``cause`` is its exception.

:func:`ask` wraps ``get`` for callers that end the run on any of them, with a :class:`PartFailed` naming
the part and, when Ray lost nodes of the run, which ones and what they held.

Worked example::

    cluster = RayCluster(placement)
    rank = cluster.spawn("rank0", TrainerRank, settings, 0, 1, run_dir, 1)   # an Actor[TrainerRank]
    host, port = ask(cluster, cluster.call(rank, TrainerRank.endpoint), 60.0, "trainer rank 0")

``spawn`` checks the constructor's arguments the same way and returns an :class:`Actor` of the class, and
``call`` checks that the method is one of that class's: an async method's call is typed by what it returns
once awaited, as Ray awaits it in the actor. How many calls an actor runs at once is its class's
``max_concurrency`` (a server host answers ``health`` while its ``start`` runs), else one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

R = TypeVar("R")
S = TypeVar("S")
P = ParamSpec("P")

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


class Pending(Generic[R]):
    """A call in flight whose value will be an ``R``; ``ref`` is the cluster's own token for it (Ray: the
    ``ObjectRef``)."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref


class Actor(Generic[S]):
    """A started actor of class ``S``; ``ref`` is the cluster's own reference to it (Ray: the actor handle).
    Only :meth:`Cluster.call` and :meth:`Cluster.kill` use it."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref


def max_concurrency(cls: object) -> int | None:
    """How many calls an actor of ``cls`` runs at once: the class's ``max_concurrency`` (None: one)."""
    value = getattr(cls, "max_concurrency", None)
    return value if isinstance(value, int) else None


class Cluster(ABC):
    """Actors placed by part name (``queue``, ``rollouter``, ``server<i>``, ``rank<i>``)."""

    @abstractmethod
    def spawn(self, part: str, cls: Callable[P, S], *args: P.args, **kwargs: P.kwargs) -> Actor[S]:
        """Start ``cls(*args, **kwargs)`` as an actor in the place reserved for ``part`` (running
        :func:`max_concurrency` calls at once); return it."""

    @overload
    def call(
        self,
        actor: Actor[S],
        method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]: ...
    @overload
    def call(
        self, actor: Actor[S], method: Callable[Concatenate[S, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]: ...
    @abstractmethod
    def call(self, actor: Actor[Any], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending[Any]:
        """Start ``method`` (a method of the actor's class, e.g. ``TrainerRank.step``) on ``actor`` with
        ``args`` and ``kwargs``; return the pending call for :meth:`get` / :meth:`wait` (an async method's
        value is what its coroutine returns)."""

    @overload
    def get(self, calls: Pending[R], timeout_s: float) -> R: ...
    @overload
    def get(self, calls: list[Pending[R]], timeout_s: float) -> list[R]: ...
    @abstractmethod
    def get(self, calls: Any, timeout_s: float) -> Any:
        """The value of one call, or the list of values of a list of calls; raises :class:`ActorDied`,
        :class:`CallTimedOut` or :class:`CallFailed`."""

    @abstractmethod
    def wait(self, calls: list[Pending[R]], timeout_s: float) -> tuple[list[Pending[R]], list[Pending[R]]]:
        """(finished, pending) once every call finished or ``timeout_s`` passed (0: look, do not wait)."""

    @abstractmethod
    def kill(self, actor: Actor[Any]) -> None:
        """End the actor now, without its clean-up (a dead one is no error)."""

    def done(self, call: Pending[Any]) -> bool:
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


@overload
def ask(cluster: Cluster, calls: Pending[R], timeout_s: float, what: str) -> R: ...
@overload
def ask(cluster: Cluster, calls: list[Pending[R]], timeout_s: float, what: str) -> list[R]: ...
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


def gather_ranks(cluster: Cluster, calls: list[Pending[R]], what: str, timeout_s: float) -> list[R]:
    """The values of one call to every trainer rank (they run collectives together); a dead rank is a
    :class:`TrainerDied`, a hang or an error a :class:`PartFailed`."""
    try:
        return cluster.get(calls, timeout_s)
    except ActorDied as err:
        raise TrainerDied(f"a trainer rank died during {what}: {first_line(err)}") from err
    except CallTimedOut as err:
        raise PartFailed(f"trainer {what} did not finish within {timeout_s:.0f} s") from err
    except CallFailed as err:
        raise PartFailed(f"trainer {what} failed: {err.cause if err.cause is not None else err}") from err


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

    def spawn(self, part: str, cls: Callable[P, S], *args: P.args, **kwargs: P.kwargs) -> Actor[S]:
        import ray

        concurrency = max_concurrency(cls)
        options = {} if concurrency is None else {"max_concurrency": concurrency}
        opts = self.placement.options(part, **options) if self.placement is not None else options
        return Actor(ray.remote(cls).options(**opts).remote(*args, **kwargs))

    def call(self, actor: Actor[Any], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending[Any]:
        # Ray's actor handles expose methods by name only: the one name lookup (module docstring).
        return Pending(getattr(actor.ref, method.__name__).remote(*args, **kwargs))

    def get(self, calls: Any, timeout_s: float) -> Any:
        import ray

        refs = [c.ref for c in calls] if isinstance(calls, list) else calls.ref
        try:
            return ray.get(refs, timeout=timeout_s)
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
        ready, _ = ray.wait([c.ref for c in calls], num_returns=len(calls), timeout=timeout_s)
        done = set(ready)
        return [c for c in calls if c.ref in done], [c for c in calls if c.ref not in done]

    def kill(self, actor: Actor[Any]) -> None:
        import ray

        try:
            ray.kill(actor.ref, no_restart=True)
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
    "Actor",
    "ActorDied",
    "CallFailed",
    "CallTimedOut",
    "Cluster",
    "PartFailed",
    "Pending",
    "RayCluster",
    "TrainerDied",
    "ask",
    "gather_ranks",
    "lost_note",
    "max_concurrency",
]
