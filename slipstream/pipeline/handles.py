"""Typed handles to the run's actors: one method per operation the controller performs on a role.

The launcher, the step driver, the supervisor, the judge watch and the checkpoint coordinator never call an
actor by a method name: they hold a handle and call its methods, whose signatures say what goes in and what
comes back (the Structs of ``pipeline/types.py``). Each handle method names the actor class's own method
(``TrainerRank.publish``), so a reader, a type checker and a dead-code scan follow ``StepDriver.push`` to
``TrainerGroup.publish`` to ``TrainerRank.publish``. Handles sit on the :class:`~.cluster.Cluster`
interface, so the fake cluster of ``tests/pipeline/fake_cluster.py`` runs behind the same handles.

==================  =========================================  =========================================
handle              actor(s)                                   what the controller does with it
==================  =========================================  =========================================
QueueHandle         ``queue.server.QueueServerActor``          address, liveness, pid, stop
ServerHandle        ``actors.ServerHost`` (one server)         start/restart, health, last output, the
                                                               server process's pid, stop
TrainerGroup        ``actors.TrainerRank`` x ``num_ranks``     rendezvous, setup, step, publish, save,
                                                               servers of the publisher (rank 0), pids,
                                                               close
RolloutHandle       ``actors.RolloutWorker``                   start, status, version, drain, metrics,
                                                               evaluation, state, servers, judges, pid,
                                                               stop
==================  =========================================  =========================================

Each handle holds a typed :class:`~slipstream.pipeline.cluster.Actor` of its class, so a checker sees a
method of another class passed to ``cluster.call``; the pids are for tools that watch or kill the run's
processes (``system/soak.py``, the fault tests).

Calls that every trainer rank must run together (``setup``, ``step``, ``publish``, ``save``,
``attach_servers``) go to all ranks at once; a dead rank is a
:class:`~slipstream.pipeline.cluster.TrainerDied`. The others wait with
:data:`~slipstream.pipeline.cluster.CALL_TIMEOUT_S` unless a timeout is given, and end the run with a
:class:`~slipstream.pipeline.cluster.PartFailed` naming the part when it fails.

Worked example::

    trainer = TrainerGroup(cluster, [cluster.spawn(f"rank{r}", TrainerRank, ...) for r in range(2)])
    host, port = trainer.endpoint()
    trainer.setup(RankSetup(host, port, queue_address), timeout_s=600)   # [0, 0]: every rank's version
    report = trainer.publish(1, timeout_s=120)                           # PushReport of rank 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from slipstream.pipeline.actors import RolloutWorker, ServerHost, TrainerRank
from slipstream.pipeline.cluster import CALL_TIMEOUT_S, Actor, Cluster, Pending, ask, gather_ranks
from slipstream.pipeline.types import (
    PushReport,
    RankSetup,
    RolloutStart,
    RolloutStatus,
    ServerHealth,
    StepReport,
)
from slipstream.rollouter.state import RolloutState

if TYPE_CHECKING:
    from slipstream.queue.server import QueueServerActor

R = TypeVar("R")


class QueueHandle:
    """The queue server actor (``QueueServerActor``)."""

    def __init__(self, cluster: Cluster, actor: Actor[QueueServerActor]) -> None:
        self.cluster, self.actor = cluster, actor

    def address(self, timeout_s: float) -> str:
        from slipstream.queue.server import QueueServerActor

        return ask(
            self.cluster, self.cluster.call(self.actor, QueueServerActor.address), timeout_s, "queue server"
        )

    def is_alive(self) -> bool:
        from slipstream.queue.server import QueueServerActor

        call = self.cluster.call(self.actor, QueueServerActor.is_alive)
        return ask(self.cluster, call, CALL_TIMEOUT_S, "queue server")

    def pid(self) -> int:
        """The queue server's process (the actor's: it serves on a thread of its own)."""
        from slipstream.queue.server import QueueServerActor

        call = self.cluster.call(self.actor, QueueServerActor.pid)
        return ask(self.cluster, call, CALL_TIMEOUT_S, "queue server")

    def stop(self) -> list[Pending[None]]:
        from slipstream.queue.server import QueueServerActor

        return [self.cluster.call(self.actor, QueueServerActor.stop)]


class ServerHandle:
    """One inference server's host actor (``ServerHost``); ``name`` says which in errors."""

    def __init__(self, cluster: Cluster, actor: Actor[ServerHost], name: str) -> None:
        self.cluster, self.actor, self.name = cluster, actor, name

    def start(self) -> Pending[str]:
        """(Re)start the server; the pending call's value is its URL once it answers ``/health``."""
        return self.cluster.call(self.actor, ServerHost.start)

    def health(self) -> ServerHealth:
        """One probe; raises :class:`~slipstream.pipeline.cluster.ActorDied` when the host actor is gone."""
        return self.cluster.get(self.cluster.call(self.actor, ServerHost.health), CALL_TIMEOUT_S)

    def log_tail(self) -> str:
        return ask(
            self.cluster, self.cluster.call(self.actor, ServerHost.log_tail), CALL_TIMEOUT_S, self.name
        )

    def pid(self) -> int | None:
        """The inference server process's pid (not its host actor's); None while none runs."""
        return ask(self.cluster, self.cluster.call(self.actor, ServerHost.pid), CALL_TIMEOUT_S, self.name)

    def stop(self) -> list[Pending[int | None]]:
        return [self.cluster.call(self.actor, ServerHost.stop)]


class TrainerGroup:
    """Every trainer rank (``TrainerRank``); ``ranks[0]`` owns the queue client and the weight publisher."""

    def __init__(self, cluster: Cluster, ranks: list[Actor[TrainerRank]]) -> None:
        self.cluster, self.ranks = cluster, ranks

    def endpoint(self) -> tuple[str, int]:
        """Rank 0's rendezvous address for the process group."""
        call = self.cluster.call(self.ranks[0], TrainerRank.endpoint)
        return ask(self.cluster, call, CALL_TIMEOUT_S, "trainer rank 0")

    def setup(self, setup: RankSetup, timeout_s: float) -> list[int]:
        """Every rank joins, builds its engine and resumes; returns each rank's version."""
        calls = [self.cluster.call(r, TrainerRank.setup, setup) for r in self.ranks]
        return ask(self.cluster, calls, timeout_s, "trainer ranks")

    def step(self) -> list[Pending[StepReport]]:
        """Start one step on every rank (the step driver takes the reports as they arrive)."""
        return [self.cluster.call(r, TrainerRank.step) for r in self.ranks]

    def publish(self, version: int, timeout_s: float) -> PushReport:
        """Every rank pushes ``version`` (rank 0 sends); returns rank 0's report."""
        calls = [self.cluster.call(r, TrainerRank.publish, version) for r in self.ranks]
        return gather_ranks(self.cluster, calls, "publish", timeout_s)[0]

    def attach_servers(self, urls: list[str], token: str) -> None:
        """Rank 0's publisher pushes to ``urls`` from now on (the other ranks ignore it)."""
        calls = [self.cluster.call(r, TrainerRank.attach_servers, urls, token) for r in self.ranks]
        gather_ranks(self.cluster, calls, "attach_servers", CALL_TIMEOUT_S)

    def save(self, path: str, timeout_s: float) -> None:
        calls = [self.cluster.call(r, TrainerRank.save, path) for r in self.ranks]
        gather_ranks(self.cluster, calls, "save", timeout_s)

    def add_server(self, url: str, timeout_s: float) -> PushReport:
        """Rank 0 brings a restarted server to the last pushed version."""
        call = self.cluster.call(self.ranks[0], TrainerRank.add_server, url)
        return ask(self.cluster, call, timeout_s, "trainer")

    def remove_server(self, url: str) -> None:
        call = self.cluster.call(self.ranks[0], TrainerRank.remove_server, url)
        ask(self.cluster, call, CALL_TIMEOUT_S, "trainer rank 0")

    def pids(self) -> list[int]:
        """Each rank's process, in rank order."""
        calls = [self.cluster.call(r, TrainerRank.pid) for r in self.ranks]
        return ask(self.cluster, calls, CALL_TIMEOUT_S, "trainer ranks")

    def kill(self) -> None:
        for rank in self.ranks:
            self.cluster.kill(rank)

    def stop(self) -> list[Pending[None]]:
        return [self.cluster.call(r, TrainerRank.close) for r in self.ranks]


class RolloutHandle:
    """The rollouter's actor (``RolloutWorker``)."""

    def __init__(self, cluster: Cluster, actor: Actor[RolloutWorker]) -> None:
        self.cluster, self.actor = cluster, actor

    def start(self, start: RolloutStart, timeout_s: float) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.start, start), timeout_s)

    def status(self) -> RolloutStatus:
        return self._ask(self.cluster.call(self.actor, RolloutWorker.status))

    def set_version(self, version: int) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.set_version, version))

    def set_staleness_threshold(self, staleness_threshold: float) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.set_staleness_threshold, staleness_threshold))

    def drain(self, timeout_s: float) -> float:
        """Wait until no group is in flight; returns the seconds it took."""
        return self._ask(self.cluster.call(self.actor, RolloutWorker.drain), timeout_s, "rollouter drain")

    def metrics(self) -> dict[str, float]:
        return self._ask(self.cluster.call(self.actor, RolloutWorker.metrics))

    def finish_eval(self, version: int, timeout_s: float) -> None:
        call = self.cluster.call(self.actor, RolloutWorker.finish_eval, version)
        self._ask(call, timeout_s, "the final evaluation")

    def state_dict(self) -> RolloutState:
        return self._ask(self.cluster.call(self.actor, RolloutWorker.state_dict))

    def add_server(self, url: str) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.add_server, url))

    def remove_server(self, url: str) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.remove_server, url))

    def set_judge_urls(self, urls: list[str]) -> None:
        self._ask(self.cluster.call(self.actor, RolloutWorker.set_judge_urls, urls))

    def pid(self) -> int:
        return self._ask(self.cluster.call(self.actor, RolloutWorker.pid))

    def stop(self) -> list[Pending[None]]:
        return [self.cluster.call(self.actor, RolloutWorker.stop)]

    def _ask(self, call: Pending[R], timeout_s: float = CALL_TIMEOUT_S, what: str = "rollouter") -> R:
        return ask(self.cluster, call, timeout_s, what)


__all__ = ["QueueHandle", "RolloutHandle", "ServerHandle", "TrainerGroup"]
