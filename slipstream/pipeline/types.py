"""The messages between the controller and its Ray actors: every call's arguments that are more than one
value, and every report an actor returns.

Ray carries Python objects between processes, so these msgspec Structs travel as they are; what they buy
is a contract a type checker and a reader can see (``report.ok``, not ``report.get("ok", [])``), one
place to read what each side promises, and cheap construction (``gc=False``: no cycles, many per step).

===================  ======================================  =============================================
struct               who sends it                            what it carries
===================  ======================================  =============================================
RankSetup            controller -> TrainerRank.setup         rendezvous, queue address, checkpoint to load
StepReport           TrainerRank.step -> controller          trainer metrics; rank 0: uids, lease wait
PushReport           TrainerRank.publish / add_server        the publisher's report (rank 0) and wall time
ServerHealth         ServerHost.health -> controller         process alive, ``/health`` answering
RolloutStart         controller -> RolloutWorker.start       servers, judges, queue, saved state, version
RolloutStatus        RolloutWorker.status -> controller      generation done, or the error that ended it
===================  ======================================  =============================================

Worked example::

    report = StepReport(version=3, metrics={"trainer/loss": 0.1}, uids=["e0-p1-0"], lease_wait_s=0.2)
    report.version, report.uids     # 3, ['e0-p1-0']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from slipstream.rollouter.state import RolloutState

if TYPE_CHECKING:  # the publisher imports torch, which a server host's process never needs
    from slipstream.weightsync.publisher import PublishReport


class RankSetup(msgspec.Struct, frozen=True, gc=False):
    """What every trainer rank needs to join the run: rank 0's rendezvous address, the queue server, and
    the checkpoint to resume from (None: a fresh start)."""

    master_host: str
    master_port: int
    queue_address: str
    resume_path: str | None = None


class StepReport(msgspec.Struct, frozen=True, gc=False):
    """One trainer step as one rank saw it. ``metrics`` are the trainer's ``trainer/*`` numbers (the same
    on every rank); ``uids`` (the samples trained) and ``lease_wait_s`` (time spent waiting for the batch)
    are rank 0's alone, empty and 0 on the others."""

    version: int
    metrics: dict[str, float]
    uids: list[str] = []
    lease_wait_s: float = 0.0


class PushReport(msgspec.Struct, frozen=True, gc=False):
    """A weight push or a restarted server's catch-up. ``publish`` is None on ranks other than 0 (they
    only drive the all-gathers) and when rank 0 had nothing to send (no kept copy yet, after a trainer
    restart: the server joins after the next push)."""

    publish: PublishReport | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> list[str]:
        return self.publish.ok if self.publish is not None else []

    @property
    def failed(self) -> dict[str, str]:
        return self.publish.failed if self.publish is not None else {}


class ServerHealth(msgspec.Struct, frozen=True, gc=False):
    """One inference server's process state and one ``/health`` probe."""

    alive: bool
    healthy: bool
    returncode: int | None = None
    pid: int | None = None


class RolloutStart(msgspec.Struct, frozen=True, gc=False):
    """Everything the rollouter starts from: the servers' URLs, the queue server, its saved state (None on a
    fresh run), the weight version the servers hold, and the servers' control token; with judge servers
    started by the run (``reward.service.launch``) their URLs and their own token, for the reward service."""

    urls: list[str]
    queue_address: str
    version: int
    state: RolloutState | None = None
    token: str = ""
    judge_urls: list[str] = []
    judge_token: str = ""


class RolloutStatus(msgspec.Struct, frozen=True, gc=False):
    """``done`` once every prompt is generated and put; ``error`` names what ended the rollouter early."""

    done: bool = False
    error: str | None = None


__all__ = ["PushReport", "RankSetup", "RolloutStart", "RolloutStatus", "ServerHealth", "StepReport"]
