"""A cluster without Ray, processes or sockets, for unit tests of the controller's parts.

The parts under test reach it through the same typed handles as production (``pipeline/handles.py``), which
name the actor classes' methods (``TrainerRank.add_server``); the fake runs the method of the same name on a
plain object chosen by part name (``server0``, ``judge0`` -> :class:`FakeServer`, ``rank0`` ->
:class:`FakeRank`, ``rollouter``, ``queue``); the class passed to ``spawn`` is never built. Calls run at
once, unless the test holds them (``hold("server0", "start")``): a held call stays pending until
``finish`` runs it, which is how a test walks a server restart through its states without waiting. Every
call is recorded in ``log`` as ``(part, method name, args)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.config import load_config
from slipstream.pipeline.cluster import Actor, ActorDied, CallFailed, CallTimedOut, Cluster, Pending
from slipstream.pipeline.types import PushReport, RolloutStatus, ServerHealth


def fake_config(*overrides: str):
    """A default config with fast health settings; ``overrides`` as on the command line."""
    return load_config(
        None,
        ["cluster.health_interval_s=1", "cluster.unhealthy_checks=2", "cluster.max_restarts=2", *overrides],
    )


class FakeServer:
    """An inference server host: ``start`` hands out a new URL each time; ``health`` is what the test set."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.starts = 0
        self.health_now = ServerHealth(alive=True, healthy=True, pid=100)

    def start(self) -> str:
        self.starts += 1
        return f"http://{self.part}:{8000 + self.starts}"

    def health(self) -> ServerHealth:
        return self.health_now

    def log_tail(self, lines: int = 20) -> str:
        return f"{self.part}: last words"

    def pid(self) -> int | None:
        return 1000 + self.starts if self.starts else None

    def stop(self) -> None:
        return None


class FakeRank:
    """A trainer rank; ``kept_copy`` False makes ``add_server`` answer as a freshly restarted rank 0 does."""

    version = 0
    kept_copy = True

    def __init__(self, part: str) -> None:
        self.part = part

    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", 29500

    def pid(self) -> int:
        return 2000 + int(self.part.removeprefix("rank"))

    def setup(self, setup: Any) -> int:
        return FakeRank.version

    def attach_servers(self, urls: list[str], token: str = "") -> None:
        return None

    def add_server(self, url: str) -> PushReport:
        from slipstream.weightsync.publisher import PublishReport

        if not FakeRank.kept_copy:
            return PushReport()
        return PushReport(PublishReport(version=FakeRank.version, ok=[url]))

    def remove_server(self, url: str) -> None:
        return None


class FakeRollouter:
    def __init__(self, part: str) -> None:
        self.error: str | None = None
        self.servers: set[str] = set()
        self.judge_urls: list[str] = []

    def status(self) -> RolloutStatus:
        return RolloutStatus(error=self.error)

    def add_server(self, url: str) -> None:
        self.servers.add(url)

    def remove_server(self, url: str) -> None:
        self.servers.discard(url)

    def set_judge_urls(self, urls: list[str]) -> None:
        self.judge_urls = list(urls)

    def pid(self) -> int:
        return 3000


class FakeQueue:
    def __init__(self, part: str) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def address(self) -> str:
        return "tcp://queue:5555"

    def pid(self) -> int:
        return 4000


KINDS = {
    "server": FakeServer,
    "judge": FakeServer,
    "rank": FakeRank,
    "rollouter": FakeRollouter,
    "queue": FakeQueue,
}


class FakeActor(Actor):
    def __init__(self, part: str) -> None:
        super().__init__(self)
        self.part = part
        self.obj = KINDS.get(part.rstrip("0123456789"), FakeQueue)(part)
        self.dead = False


class FakeCall(Pending):
    def __init__(self, actor: FakeActor, method: str, args: tuple) -> None:
        super().__init__(self)
        self.actor, self.method, self.args = actor, method, args
        self.done = False
        self.value: Any = None
        self.error: Exception | None = None

    def run(self) -> None:
        self.done = True
        if self.actor.dead:
            self.error = ActorDied(f"{self.actor.part} is dead")
            return
        try:
            self.value = getattr(self.actor.obj, self.method)(*self.args)
        except Exception as err:
            self.error = CallFailed(str(err), err)


class FakeCluster(Cluster):
    def __init__(self) -> None:
        self.actors: list[FakeActor] = []
        self.log: list[tuple[str, str, tuple]] = []
        self.killed: list[str] = []
        self.no_room: set[str] = set()
        self.lost: dict[str, list[str]] = {}
        self._held: dict[tuple[str, str], list[FakeCall]] = {}

    # ------------------------------------------------------------------ the interface
    def spawn(self, part: str, cls: Any, *args: Any, **kwargs: Any) -> FakeActor:
        actor = FakeActor(part)
        self.actors.append(actor)
        return actor

    def call(self, actor: FakeActor, method: Callable[..., Any], *args: Any, **kwargs: Any) -> FakeCall:
        name = method.__name__
        self.log.append((actor.part, name, args))
        call = FakeCall(actor, name, args)
        if (actor.part, name) in self._held:
            self._held[(actor.part, name)].append(call)
        else:
            call.run()
        return call

    def get(self, calls: Any, timeout_s: float) -> Any:
        if isinstance(calls, list):
            return [self.get(c, timeout_s) for c in calls]
        if not calls.done:
            raise CallTimedOut(f"{calls.actor.part}.{calls.method}")
        if calls.error is not None:
            raise calls.error
        return calls.value

    def wait(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        return [c for c in calls if c.done], [c for c in calls if not c.done]

    def kill(self, actor: FakeActor) -> None:
        actor.dead = True
        self.killed.append(actor.part)

    def has_room(self, part: str) -> bool:
        return part not in self.no_room

    def demand(self, part: str) -> dict[str, float]:
        return {"GPU": 1.0}

    def lost_nodes(self) -> dict[str, list[str]]:
        return dict(self.lost)

    def release(self) -> None:
        return None

    # ------------------------------------------------------------------ what tests do
    def die(self, actor: FakeActor) -> None:
        actor.dead = True

    def hold(self, part: str, method: str) -> None:
        self._held.setdefault((part, method), [])

    def finish(self, part: str, method: str) -> None:
        for call in self._held.pop((part, method), []):
            call.run()

    def calls_of(self, part: str, method: str) -> list[tuple]:
        return [args for p, m, args in self.log if p == part and m == method]

    def actor(self, part: str) -> FakeActor:
        """The newest actor of ``part`` (a replaced host has an older, dead one)."""
        return [a for a in self.actors if a.part == part][-1]
