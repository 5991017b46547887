"""Health watching and the restart policy: which dead part is restarted, which ends the run.

The step driver calls :meth:`Supervisor.watch` while a step runs (checks at most every
``cluster.health_interval_s``; restarts in progress move on at every call). A check covers the rollouter
(actor alive, its task not failed), the queue server, and every inference server (process alive,
``/health`` answering). A dead part fails the run with a :class:`PartFailed` naming it, except:

* a dead inference server with ``cluster.restart_servers`` (up to ``cluster.max_restarts`` each): it is
  taken out of the balancer and the publisher, started again on its node (a new host actor when the old
  one died), brought to the current weight version by rank 0 (``add_server``) and only then put back into
  the balancer. Right after a trainer restart rank 0 holds no copy of the weights yet: the server then
  joins after the next push (:meth:`joined_after_push`). A server whose node died waits for room in the
  rollout pool; past ``health_interval_s x unhealthy_checks`` the run goes on with the servers left, or
  stops when none is left;
* a dead judge server of ``reward.service.launch``, under the same rule: restarted without weights
  (``judges.py``), out of the reward service's URLs meanwhile;
* a dead trainer rank with ``cluster.restart_trainer`` (up to ``cluster.max_restarts``): every rank is
  replaced and resumes from the latest checkpoint (a save that died after its queue snapshot is completed
  first), rolling the live queue back to that checkpoint's snapshot; the rollouter and the servers keep
  running. Refused without a checkpoint, or when the queue server's node is gone.

States of a server, as :attr:`servers_restarting` and :attr:`servers_without_room` show them::

    serving --(dies)--> restarting --(start done)--> catching up --(add_server ok)--> serving
                            |                              \\--(no kept copy)--> joining --(next push)--> serving
                            \\--(node gone, no room)--> without room --(room appears)--> restarting

Everything it does goes through the :class:`~slipstream.pipeline.cluster.Cluster` interface and an
injected clock, so ``tests/pipeline/test_supervisor.py`` runs the policy on a fake cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from slipstream.config import Config
from slipstream.pipeline import checkpoint as ckpt
from slipstream.pipeline.cluster import Cluster, PartFailed, lost_note
from slipstream.pipeline.health import HostPool
from slipstream.pipeline.judges import JudgeWatch
from slipstream.pipeline.launcher import Launcher
from slipstream.pipeline.parts import Parts
from slipstream.pipeline.types import PushReport
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class Supervisor:
    """Watches the parts and applies the restart policy (module docstring). ``restarts`` counts restarts
    per part (``server-<i>``, ``judge-<i>``, ``trainer``)."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        parts: Parts,
        launcher: Launcher,
        *,
        run_dir: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.cluster, self.parts, self.launcher = cfg, cluster, parts, launcher
        self.run_dir = run_dir
        self.ckpt_root = ckpt.checkpoint_root(run_dir)
        self.clock = clock
        self.server_token = launcher.server_token
        self.restarts: dict[str, int] = {}
        # The restart flow shared with the judge servers (health.HostPool); what is particular to a rollout
        # server (the balancer, the publisher, the weights, room on a lost node) is here.
        self.servers = HostPool(
            cfg.cluster, cluster, "inference server", "server", parts.servers, launcher.new_host,
            self.restarts,
        )  # fmt: skip
        self._restart_began: dict[int, float] = {}
        self._no_room: set[int] = set()  # restarting servers whose node is gone and that have no room yet
        self._joining: list[str] = []  # restarted servers waiting for a push before they take requests
        self._next_health = 0.0
        # The judge servers of reward.service.launch: the same policy, without weights (judges.py).
        self.judges = JudgeWatch(cfg, cluster, parts, launcher, self.restarts)

    # ------------------------------------------------------------------ what callers see
    @property
    def servers_restarting(self) -> set[int]:
        """Indices of the servers being restarted (not yet back in the balancer)."""
        return self.servers.restarting

    @property
    def servers_without_room(self) -> set[int]:
        """Restarting servers whose node is gone and for which the rollout pool has no room yet."""
        return set(self._no_room)

    def live_urls(self) -> list[str]:
        return self.parts.servers.live_urls()

    # ------------------------------------------------------------------ health
    def watch(self) -> None:
        """Health checks, at most every ``cluster.health_interval_s``; restarts progress between them."""
        self._progress_restarts()
        self.judges.progress()
        if self.clock() < self._next_health:
            return
        self._next_health = self.clock() + self.cfg.cluster.health_interval_s
        self._check_rollouter()
        self._check_queue()
        for index, reason, replace_host in self.servers.deaths():
            self._server_died(index, reason, replace_host=replace_host)
        self.judges.check()

    def poll(self) -> None:
        """Run the health checks now (and move restarts on)."""
        self._next_health = 0.0
        self.watch()

    def _check_rollouter(self) -> None:
        status = self.parts.rollouter.status()
        if status.error:
            raise PartFailed(f"the rollouter failed: {status.error} (see {self.run_dir}/logs/rollouter.log)")

    def _check_queue(self) -> None:
        if not self.parts.queue.is_alive():
            raise PartFailed("the queue server's loop stopped (see the Ray logs of QueueServerActor)")

    # ------------------------------------------------------------------ server restarts
    def _server_died(self, index: int, reason: str, *, replace_host: bool = False) -> None:
        self.servers.count(index, reason, replace_host)
        url = self.parts.servers[index].url
        self.parts.rollouter.remove_server(url)
        self.parts.trainer.remove_server(url)
        self.servers.restart(index, replace_host)
        self._restart_began[index] = self.clock()

    def _progress_restarts(self) -> None:
        for index, url in self.servers.finished():
            self._no_room.discard(index)
            self._catch_up(index, url)
        for index in sorted(self.servers.restarting):
            self._check_room(index)

    def _catch_up(self, index: int, url: str) -> None:
        """Bring a restarted server to the published version, then let it take requests."""
        report = self.parts.trainer.add_server(url, 4 * self.cfg.weightsync.timeout_s)
        if report.publish is None and self.parts.published > 0:
            self._joining.append(url)  # no kept copy yet (a restarted trainer): joins after the next push
        elif report.publish is not None and url not in report.ok:
            raise PartFailed(
                f"restarted server {url} could not take version {report.publish.version}: {report.publish}"
            )
        else:
            self.parts.rollouter.add_server(url)
            log.info("server %d is back at %s with version %d", index, url, self.parts.published)

    def joined_after_push(self, report: PushReport, version: int) -> None:
        """Servers waiting for a push that this push reached take requests again."""
        for url in [u for u in self._joining if u in report.ok]:
            self.parts.rollouter.add_server(url)
            self._joining.remove(url)
            log.info("restarted server %s serves version %d and takes requests again", url, version)

    def _check_room(self, index: int) -> None:
        """A server restarting after its node died waits for room in the rollout pool (module docstring)."""
        c = self.cfg.cluster
        name = f"server{index}"
        if self.cluster.has_room(name):
            return
        if self.clock() - self._restart_began.get(index, 0.0) < c.health_interval_s * c.unhealthy_checks:
            return
        left = len(self.parts.servers.live_urls())
        what = (
            f"inference server {index} lost its node and the rollout pool has no room left for it "
            f"({self.cluster.demand(name)})"
        )
        if left == 0:
            raise PartFailed(f"{what}; no server is left{lost_note(self.cluster)}")
        if index not in self._no_room:
            self._no_room.add(index)
            log.warning("%s; the run goes on with %d server(s) and starts it when room appears", what, left)

    # ------------------------------------------------------------------ trainer restarts
    def restart_trainer(self, reason: str) -> int:
        """Replace every trainer rank from the latest checkpoint, or raise PartFailed saying why not;
        returns the version the new ranks resumed at."""
        count = self.restarts.get("trainer", 0)
        salvaged = ckpt.salvage(self.ckpt_root) if self.ckpt_root.is_dir() else None
        if salvaged is not None:
            log.warning(
                "the trainer died after the queue snapshot of %s; completed that checkpoint", salvaged
            )
        resume = ckpt.latest(self.ckpt_root)
        why = self.trainer_restart_refusal(count, resume)
        if why is not None:
            raise PartFailed(
                f"trainer failed at version {self.parts.version} ({reason}); not restarted: {why}"
                f"{lost_note(self.cluster)}"
            )
        log.warning("%s; restarting the trainer from %s", reason, resume)
        self.restarts["trainer"] = count + 1
        self.parts.trainer.kill()
        version = self.launcher.start_trainer(self.parts, resume)
        self.parts.trainer.attach_servers(self.live_urls(), self.server_token)
        log.info("trainer restarted at version %d (servers keep version %d)", version, self.parts.published)
        return version

    def trainer_restart_refusal(self, count: int, resume: Path | None) -> str | None:
        """Why a dead trainer is not restarted (None: it is)."""
        c = self.cfg.cluster
        if not c.restart_trainer:
            return "cluster.restart_trainer is off"
        if count >= c.max_restarts:
            return f"cluster.max_restarts={c.max_restarts} used up"
        if resume is None:
            return "no checkpoint to restart from"
        if any("queue" in parts for parts in self.cluster.lost_nodes().values()):
            return "the queue server's node is gone"
        return None


__all__ = ["Supervisor"]
