"""The single controller: start every part of a run, drive the trainer, move weights, watch health, stop.

Control goes through here, data never does (design.md §1). :class:`Pipeline` runs in the driver process
and owns the Ray actors of ``pipeline/actors.py``:

::

    trainer pool   TrainerRank x trainer.num_ranks (rank 0: queue client + WeightPublisher), the queue
    rollout pool   ServerHost x rollout.num_servers (one inference server process each), RolloutWorker

Start-up, in order: Ray (local, or ``cluster.ray_address``); the model prepared (known names); the queue;
the servers (healthy); the trainer ranks (process group, engine, resume from the latest checkpoint with
the queue restored from its snapshot); a first push when resuming (fresh servers serve version 0); the
rollouter (its saved state restored), which then streams groups into the queue on its own.

Each step: every rank runs ``step()`` (rank 0 leases a batch, all train, rank 0 acks); every
``async.sync_every`` steps the controller drains the rollouter (``partial_rollout: off``), has the ranks
push the new version and tells the rollouter (``set_version`` opens the staleness gate); every
``trainer.checkpoint_every`` steps a checkpoint (``pipeline/checkpoint.py``); then one metrics record.

While a step runs the controller checks health every ``cluster.health_interval_s``: the rollouter (actor
alive, its task not failed), the queue server, every inference server (process alive, ``/health``
answering). A dead part fails the run with a :class:`PartFailed` naming it, except:

* a dead inference server with ``cluster.restart_servers``: it is taken out of the balancer and the
  publisher, started again on its node, brought to the current weight version (``publisher.add_server``)
  and only then put back into the balancer; requests it held are re-sent by the balancer (or wait for it
  when it was the only one);
* a dead trainer rank with ``cluster.restart_trainer``: every rank is replaced, resumes from the latest
  checkpoint and rolls the live queue back to that checkpoint's snapshot (groups trained since come back),
  while the rollouter and the servers keep running (see docs/architecture.md, "Pipeline").

One random server token per run guards the servers' control and weight-update routes: the servers get it
in their environment, the rollouter's clients and the weight publisher as an argument (for servers given by
URL it is ``$SLIPSTREAM_SERVER_TOKEN`` of this process, the one they were started with).

Every wait has a timeout (``cluster.*_timeout_s``); :meth:`Pipeline.shutdown` stops every process the run
started, on success, on error and on Ctrl-C.

Worked example::

    result = Pipeline(load_config("configs/quickstart.yaml")).run()
    result.version, result.run_dir      # 30, PosixPath('runs/quickstart')
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slipstream.config import Config, ConfigError, to_dict
from slipstream.pipeline import checkpoint as ckpt
from slipstream.pipeline.actors import RolloutWorker, ServerHost, TrainerRank, wait_for_own_children
from slipstream.pipeline.modes import check_config, check_data, make_missing_data, prepare_config
from slipstream.pipeline.types import PushReport, RankSetup, RolloutStart, StepReport
from slipstream.rollouter.state import RolloutState
from slipstream.utils.http_auth import env_token, new_token
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Seconds a quick control call (status, metrics, set_version, stop ...) may take.
CALL_TIMEOUT_S = 60.0


class PartFailed(RuntimeError):
    """A part of the run died or stopped answering; the message names the part and what happened."""


@dataclass
class RunResult:
    version: int
    run_dir: Path
    wall_s: float
    restarts: dict[str, int] = field(default_factory=dict)
    stopped: bool = False  # ended early by a stop request (SIGTERM), after a checkpoint


class _TrainerDied(Exception):
    """A trainer rank died (internal: the step loop restarts the ranks or fails the run)."""


class Pipeline:
    """One training run (module docstring). Lifecycle: construct (validates; starts nothing) → ``run()``
    (starts, trains ``total_steps``, always shuts down). ``on_step(pipeline, version, metrics)`` is called
    after every step (tests use it to inject faults)."""

    def __init__(self, cfg: Config, *, on_step: Callable[[Pipeline, int, dict], None] | None = None) -> None:
        cfg, self.notes = prepare_config(cfg)
        check_config(cfg)
        make_missing_data(cfg)
        self.total_steps = check_data(cfg)
        self.cfg = cfg
        self.on_step = on_step
        # `kill` stops a run as cleanly as Ctrl-C (the command sets this; library users keep their handler).
        self.stop_on_sigterm = False
        # `slipstream train` sets this too: a watcher process kills what is left if the driver is SIGKILLed.
        self.reap_if_killed = False
        self._stop_requested = False
        self._sigterm_before: Any = None  # the SIGTERM handler to put back at shutdown
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.ckpt_root = ckpt.checkpoint_root(self.run_dir)
        self.version = 0
        self.published = 0  # newest version the servers serve
        self.restarts: dict[str, int] = {}
        self.queue_actor = None
        self.queue_client = None
        self.hosts: list[Any] = []
        self.urls: list[str] = []
        # Servers started by the run get a fresh token; servers given by URL the one they were started with.
        self.server_token = env_token() if cfg.rollout.server_urls else (env_token() or new_token())
        self.ranks: list[Any] = []
        self.rollouter = None
        self.logger = None
        self.placement: Any = None  # pipeline.placement.Placement once Ray is up
        self._ray_started = False
        self._rollouter_started = False
        self._closed = False
        self._restarting: dict[int, Any] = {}  # server index -> ref of its start()
        self._restart_began: dict[int, float] = {}
        self._no_room: set[int] = set()  # restarting servers whose node is gone and that have no room yet
        self._joining: list[str] = []  # restarted servers waiting for a push before they take requests
        self._unhealthy: dict[int, int] = {}
        self._next_health = 0.0
        self._last_step_end = 0.0
        self._t0 = 0.0

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        self._t0 = time.monotonic()
        try:
            self._start()
            while self.version < self.total_steps and not self._stop_requested:
                self._step()
            if self.version > 0 and self._end_needs_checkpoint():
                self._checkpoint()  # the end of a run is always resumable; so is a stop on request
        finally:
            self.shutdown()
        wall = time.monotonic() - self._t0
        return RunResult(self.version, self.run_dir, wall, dict(self.restarts), self._stop_requested)

    def _end_needs_checkpoint(self) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return self.version % every != 0 if every else self._stop_requested

    def request_stop(self) -> None:
        """Finish the step in flight, write a checkpoint (even with ``checkpoint_every: 0``), stop every part.
        `slipstream train` calls this on SIGTERM (a second SIGTERM stops at once, without the checkpoint);
        the same command run again continues from that checkpoint."""
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        log.warning("stop requested: finishing step %d, then a checkpoint; SIGTERM again to stop at once",
                    self.version + 1)  # fmt: skip

    # ------------------------------------------------------------------ start-up
    def _start(self) -> None:
        from slipstream.rollouter.models import resolve_model_path

        for note in self.notes:
            log.info("%s", note)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(_yaml(self.cfg))
        self._init_ray()
        model_path = str(resolve_model_path(self.cfg.model.path))  # prepares a known model once
        self.cfg = msgspec.structs.replace(
            self.cfg, model=msgspec.structs.replace(self.cfg.model, path=model_path)
        )
        resume = self._resume_point()
        self._start_queue()
        # Servers load while the trainer ranks initialise; the rollouter's process imports meanwhile too.
        server_refs = self._launch_servers(model_path)
        self._create_rollouter()
        self.version = self._start_trainer(resume)
        if server_refs:
            self.urls = self._get(server_refs, self.cfg.cluster.start_timeout_s, "inference servers")
        self._ranks_call("attach_servers", CALL_TIMEOUT_S, self.urls, self.server_token)
        if self.version > 0:
            self._push(self.version)  # fresh servers serve the model's initial weights as version 0
        self._start_rollouter(ckpt.read_rollouter_state(resume) if resume else None)
        from slipstream.metrics import MetricsLogger

        self.logger = MetricsLogger(
            self.run_dir, self.cfg, total_steps=self.total_steps, start_step=self.version
        )
        self._last_step_end = time.monotonic()
        log.info("run %s: all parts up after %.1f s", self.cfg.run.name, time.monotonic() - self._t0)

    def _init_ray(self) -> None:
        import ray

        from slipstream.pipeline.placement import Placement, PlacementError

        self._ray_started = connect_ray(self.cfg)
        if self._ray_started and self.reap_if_killed:
            from slipstream.pipeline.reaper import start_reaper

            start_reaper()  # removes this run's processes if this driver is killed without cleaning up
        if self.stop_on_sigterm:  # after ray.init, which installs a handler of its own
            self._sigterm_before = signal.signal(signal.SIGTERM, lambda signum, frame: self.request_stop())
        wait_for_own_children()  # Ray's subreaper setting made this driver ignore SIGCHLD
        check_pools(self.cfg, ray.cluster_resources())
        check_hosts(self.cfg, sum(1 for n in ray.nodes() if n.get("Alive")))
        try:
            self.placement = Placement.reserve(self.cfg)
        except PlacementError as err:
            raise PartFailed(f"placement: {err}") from None
        log.info("placement: %s", self.placement.summary())

    def _resume_point(self) -> Path | None:
        if self.ckpt_root.is_dir():
            ckpt.prune(self.ckpt_root, self.cfg.trainer.keep_checkpoints)  # staging leftovers of a crash
        found = ckpt.latest(self.ckpt_root) if self.cfg.run.resume else None
        if found is not None:
            log.info("resuming from %s", found)
        elif (self.run_dir / ckpt.UIDS_FILE).exists():
            (self.run_dir / ckpt.UIDS_FILE).unlink()  # a fresh start: an older record would mislead
        return found

    def _start_queue(self) -> None:
        import ray

        from slipstream.queue.client import QueueClient
        from slipstream.queue.server import QueueServerActor

        actor = ray.remote(QueueServerActor).options(**self.placement.options("queue"))
        self.queue_actor = actor.remote(msgspec.to_builtins(self.cfg.queue))
        address = self._get(
            self.queue_actor.address.remote(), self.cfg.cluster.start_timeout_s, "queue server"
        )
        self.queue_address = address
        self.queue_client = QueueClient(address, shared_memory=False)

    def _launch_servers(self, model_path: str) -> list[Any]:
        """Start the server hosts; returns the refs of their URLs (none for servers given by URL)."""
        if self.cfg.rollout.server_urls:
            self.urls = [u.rstrip("/") for u in self.cfg.rollout.server_urls]
            return []
        self.hosts = [self._new_host(i, model_path) for i in range(self.cfg.rollout.num_servers)]
        return [h.start.remote() for h in self.hosts]

    def _new_host(self, index: int, model_path: str | None = None) -> Any:
        import ray

        opts = self.placement.options(f"server{index}", max_concurrency=2)
        return (
            ray.remote(ServerHost)
            .options(**opts)
            .remote(
                to_dict(self.cfg),
                index,
                model_path or self.cfg.model.path,
                str(self.run_dir),
                self.server_token,
            )
        )

    def _start_trainer(self, resume: Path | None) -> int:
        import ray

        cfg = self.cfg
        world = cfg.trainer.num_ranks
        threads = cfg.cluster.trainer_threads or max(1, (os.cpu_count() or 1) // world)
        # The controller writes checkpoints (with the rollouter's state), so the trainer's own are off.
        rank_cfg = to_dict(cfg)
        rank_cfg["trainer"]["checkpoint_every"] = 0
        self.ranks = [
            ray.remote(TrainerRank)
            .options(**self.placement.options(f"rank{r}", max_concurrency=2))
            .remote(rank_cfg, r, world, str(self.run_dir), threads)
            for r in range(world)
        ]
        host, port = self._get(self.ranks[0].endpoint.remote(), CALL_TIMEOUT_S, "trainer rank 0")
        setup = RankSetup(host, port, self.queue_address, str(resume) if resume else None)
        refs = [r.setup.remote(setup) for r in self.ranks]
        versions = self._get(refs, cfg.cluster.start_timeout_s, "trainer ranks")
        return int(versions[0])

    def _create_rollouter(self) -> None:
        import ray

        cls = ray.remote(RolloutWorker).options(**self.placement.options("rollouter"))
        self.rollouter = cls.remote(to_dict(self.cfg), str(self.run_dir))

    def _start_rollouter(self, state: RolloutState | None) -> None:
        start = RolloutStart(self.urls, self.queue_address, self.published, state, self.server_token)
        ref = self.rollouter.start.remote(start)
        self._get(ref, self.cfg.cluster.start_timeout_s, "rollouter")
        self._rollouter_started = True

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        try:
            results = self._run_step()
            metrics = self._after_step(results)
        except _TrainerDied as err:
            self._restart_trainer(str(err))
            return
        self.logger.log(self.version, metrics)
        if self.on_step is not None:
            self.on_step(self, self.version, metrics)

    def _run_step(self) -> list[StepReport]:
        import ray

        refs = [r.step.remote() for r in self.ranks]
        results: dict[Any, Any] = {}
        deadline = time.monotonic() + self.cfg.cluster.step_timeout_s
        pending = list(refs)
        while pending:
            wait_s = max(0.0, min(self.cfg.cluster.health_interval_s, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            for ref in ready:  # at once: a dead rank leaves the others blocked in a collective
                results[ref] = self._rank_result(ref)
            if pending:
                if time.monotonic() >= deadline:
                    raise PartFailed(
                        f"trainer step {self.version + 1} did not finish within cluster.step_timeout_s="
                        f"{self.cfg.cluster.step_timeout_s:.0f} s"
                    )
                self._watch()
        self._watch()  # also when steps are shorter than the health interval
        return [results[r] for r in refs]

    def _rank_result(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        # OutOfMemoryError: Ray's memory monitor killed the rank's worker (it is no RayActorError).
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as err:
            raise _TrainerDied(f"a trainer rank died: {_first_line(err)}") from err
        except ray.exceptions.RayTaskError as err:
            if self.cfg.cluster.restart_trainer:
                raise _TrainerDied(f"a trainer step failed: {_first_line(err)}") from err
            raise PartFailed(f"trainer step {self.version + 1} failed: {err}") from err

    def _after_step(self, results: list[StepReport]) -> dict[str, float]:
        now = time.monotonic()
        head = results[0]
        uids = head.uids
        self.version = head.version
        window = max(now - self._last_step_end, 1e-9)
        metrics = dict(head.metrics)
        metrics["trainer/idle_ratio"] = min(1.0, head.lease_wait_s / window)
        metrics["perf/step_wall_s"] = window
        metrics["perf/samples_per_s"] = metrics.get("trainer/samples", 0.0) / window
        metrics["perf/trained_tokens_per_s"] = metrics.get("trainer/tokens", 0.0) / window
        metrics["perf/elapsed_s"] = now - self._t0
        if self.cfg.run.record_uids:
            ckpt.record_uids(self.run_dir, self.version, uids)
        if self.version % self.cfg.async_.sync_every == 0:
            metrics.update(self._push(self.version))
        every = self.cfg.trainer.checkpoint_every
        if every and self.version % every == 0:
            metrics.update(self._checkpoint())
        if self.version >= self.total_steps and self.cfg.eval_.every > 0:
            # The last record carries the evaluation of the weights the run ends with.
            self._get(self.rollouter.finish_eval.remote(self.published), self.cfg.cluster.step_timeout_s,
                      "the final evaluation")  # fmt: skip
        metrics.update(self._side_metrics())
        self._last_step_end = time.monotonic()
        return metrics

    # ------------------------------------------------------------------ weights
    def _push(self, version: int) -> dict[str, float]:
        """Push ``version`` to every server and open the rollouter's gate for it."""
        if version <= self.published:
            # A restarted trainer replays steps the servers already have newer weights for.
            return {"sync/skipped": 1.0}
        t0 = time.monotonic()
        out: dict[str, float] = {}
        started = self._rollouter_started  # a first push on resume comes before the rollouter starts
        if self.cfg.async_.partial_rollout == "off" and started:
            timeout = self.cfg.rollout.request_timeout_s * self.cfg.agent.max_turns + 60
            out["sync/drain_s"] = float(self._get(self.rollouter.drain.remote(), timeout, "rollouter drain"))
        timeout = 4 * self.cfg.weightsync.timeout_s + 60
        report: PushReport = self._ranks_call("publish", timeout, version)[0]
        self.published = version
        if started:
            self._get(self.rollouter.set_version.remote(version), CALL_TIMEOUT_S, "rollouter")
        joined = [u for u in self._joining if u in report.ok]
        for url in joined:
            self._get(self.rollouter.add_server.remote(url), CALL_TIMEOUT_S, "rollouter")
            self._joining.remove(url)
            log.info("restarted server %s serves version %d and takes requests again", url, version)
        if report.failed:
            log.warning("version %d did not reach %s", version, ", ".join(report.failed))
        out.update({
            "sync/publish_s": time.monotonic() - t0,
            "sync/version": float(version),
            "sync/servers_ok": float(len(report.ok)),
            "sync/servers_failed": float(len(report.failed)),
            "sync/bytes": float(report.publish.bytes if report.publish is not None else 0),
        })  # fmt: skip
        return out

    def _ranks_call(self, method: str, timeout_s: float, *args: Any) -> list[Any]:
        import ray

        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        try:
            return ray.get(refs, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as err:
            raise _TrainerDied(f"a trainer rank died during {method}: {_first_line(err)}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise PartFailed(f"trainer {method} did not finish within {timeout_s:.0f} s") from err

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> dict[str, float]:
        t0 = time.monotonic()
        staging = ckpt.staging_dir(self.ckpt_root, self.version)
        state = self._get(self.rollouter.state_dict.remote(), CALL_TIMEOUT_S, "rollouter")
        ckpt.write_rollouter_state(staging, state)
        self._ranks_call("save", self.cfg.cluster.step_timeout_s, str(staging))
        final = ckpt.commit(staging)
        ckpt.prune(self.ckpt_root, self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint of version %d in %s (%.1f s)", self.version, final, time.monotonic() - t0)
        return {"ckpt/save_s": time.monotonic() - t0}

    def _restart_trainer(self, reason: str) -> None:
        import ray

        count = self.restarts.get("trainer", 0)
        salvaged = ckpt.salvage(self.ckpt_root) if self.ckpt_root.is_dir() else None
        if salvaged is not None:
            log.warning(
                "the trainer died after the queue snapshot of %s; completed that checkpoint", salvaged
            )
        resume = ckpt.latest(self.ckpt_root)
        why = None
        if not self.cfg.cluster.restart_trainer:
            why = "cluster.restart_trainer is off"
        elif count >= self.cfg.cluster.max_restarts:
            why = f"cluster.max_restarts={self.cfg.cluster.max_restarts} used up"
        elif resume is None:
            why = "no checkpoint to restart from"
        if (
            why is None
            and self.placement is not None
            and any("queue" in parts for parts in self.placement.lost_nodes().values())
        ):
            why = "the queue server's node is gone"
        if why is not None:
            raise PartFailed(
                f"trainer failed at version {self.version} ({reason}); not restarted: {why}{self._lost_note()}"
            )
        log.warning("%s; restarting the trainer from %s", reason, resume)
        self.restarts["trainer"] = count + 1
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.version = self._start_trainer(resume)
        live = [u for i, u in enumerate(self.urls) if i not in self._restarting]
        self._ranks_call("attach_servers", CALL_TIMEOUT_S, live, self.server_token)
        self._last_step_end = time.monotonic()
        log.info("trainer restarted at version %d (servers keep version %d)", self.version, self.published)

    # ------------------------------------------------------------------ health
    def poll_parts(self) -> None:
        """Run the health checks and move server restarts on now (the step loop does this every
        ``cluster.health_interval_s``); for callers of ``on_step`` that wait for a part to come back."""
        self._next_health = 0.0
        self._watch()

    @property
    def servers_restarting(self) -> set[int]:
        """Indices of the servers being restarted (not yet back in the balancer)."""
        return set(self._restarting)

    @property
    def servers_without_room(self) -> set[int]:
        """Restarting servers whose node is gone and for which the rollout pool has no room yet."""
        return set(self._no_room)

    def _watch(self) -> None:
        """Health checks, at most every ``cluster.health_interval_s``; restarts progress between them."""
        self._progress_restarts()
        if time.monotonic() < self._next_health:
            return
        self._next_health = time.monotonic() + self.cfg.cluster.health_interval_s
        self._check_rollouter()
        self._check_queue()
        for index in range(len(self.hosts)):
            if index not in self._restarting:
                self._check_server(index)

    def _check_rollouter(self) -> None:
        status = self._get(self.rollouter.status.remote(), CALL_TIMEOUT_S, "rollouter")
        if status.error:
            raise PartFailed(f"the rollouter failed: {status.error} (see {self.run_dir}/logs/rollouter.log)")

    def _check_queue(self) -> None:
        if not self._get(self.queue_actor.is_alive.remote(), CALL_TIMEOUT_S, "queue server"):
            raise PartFailed("the queue server's loop stopped (see the Ray logs of QueueServerActor)")

    def _check_server(self, index: int) -> None:
        import ray

        try:
            health = ray.get(self.hosts[index].health.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self._server_died(index, "its host actor died", replace_host=True)
            return
        if not health.alive:
            self._server_died(index, f"its process exited with code {health.returncode}")
        elif health.healthy:
            self._unhealthy.pop(index, None)
        else:
            self._unhealthy[index] = self._unhealthy.get(index, 0) + 1
            if self._unhealthy[index] >= self.cfg.cluster.unhealthy_checks:
                self._server_died(index, f"/health failed {self._unhealthy[index]} checks in a row")

    def _server_died(self, index: int, reason: str, *, replace_host: bool = False) -> None:
        import ray

        url, key = self.urls[index], f"server-{index}"
        count = self.restarts.get(key, 0)
        if not self.cfg.cluster.restart_servers or count >= self.cfg.cluster.max_restarts:
            tail = "" if replace_host else self._get(self.hosts[index].log_tail.remote(), CALL_TIMEOUT_S, key)
            why = "cluster.restart_servers is off" if count == 0 else "cluster.max_restarts used up"
            raise PartFailed(
                f"inference server {index} ({url}) died: {reason}; not restarted ({why}). Its last output:\n{tail}"
            )
        log.warning("inference server %d (%s) died: %s; restarting it (%d/%d)", index, url, reason,
                    count + 1, self.cfg.cluster.max_restarts)  # fmt: skip
        self.restarts[key] = count + 1
        self._unhealthy.pop(index, None)
        self._get(self.rollouter.remove_server.remote(url), CALL_TIMEOUT_S, "rollouter")
        self._get(self.ranks[0].remove_server.remote(url), CALL_TIMEOUT_S, "trainer rank 0")
        if replace_host:
            ray.kill(self.hosts[index], no_restart=True)
            self.hosts[index] = self._new_host(index)
        self._restarting[index] = self.hosts[index].start.remote()
        self._restart_began[index] = time.monotonic()

    def _progress_restarts(self) -> None:
        import ray

        for index, ref in list(self._restarting.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                self._check_room(index)
                continue
            del self._restarting[index]
            self._no_room.discard(index)
            try:
                url = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as err:
                raise PartFailed(f"inference server {index} could not be restarted: {err}") from err
            self.urls[index] = url
            report: PushReport = self._get(
                self.ranks[0].add_server.remote(url), 4 * self.cfg.weightsync.timeout_s, "trainer"
            )
            if report.publish is None and self.published > 0:
                self._joining.append(url)  # no kept copy yet (a restarted trainer): joins after the next push
            elif report.publish is not None and url not in report.ok:
                raise PartFailed(
                    f"restarted server {url} could not take version {report.publish.version}: {report.publish}"
                )
            else:
                self._get(self.rollouter.add_server.remote(url), CALL_TIMEOUT_S, "rollouter")
                log.info("server %d is back at %s with version %d", index, url, self.published)

    def _check_room(self, index: int) -> None:
        """A server restarting after its node died waits for Ray to find its bundle room elsewhere. Past
        ``health_interval_s x unhealthy_checks`` without room: the run goes on with the servers left (the
        server starts once room appears, e.g. a replacement node joins), or stops when none is left."""
        c = self.cfg.cluster
        name = f"server{index}"
        if self.placement is None or self.placement.has_room(name):
            return
        if time.monotonic() - self._restart_began.get(index, 0.0) < c.health_interval_s * c.unhealthy_checks:
            return
        ask = self.placement.parts[name].demand
        left = len(self.hosts) - len(self._restarting)
        what = f"inference server {index} lost its node and the rollout pool has no room left for it ({ask})"
        if left == 0:
            raise PartFailed(f"{what}; no server is left{self._lost_note()}")
        if index not in self._no_room:
            self._no_room.add(index)
            log.warning("%s; the run goes on with %d server(s) and starts it when room appears", what, left)

    # ------------------------------------------------------------------ metrics
    def _side_metrics(self) -> dict[str, float]:
        out = dict(self._get(self.rollouter.metrics.remote(), CALL_TIMEOUT_S, "rollouter"))
        stats = self.queue_client.stats()
        train = stats.partitions.get("train")
        out["queue/held_groups"] = float(stats.held_groups)
        if train is not None:
            out["queue/ready_groups"] = float(train.ready_groups)
            out["queue/put_total"] = float(train.put_total)
            out["queue/acked_total"] = float(train.acked_total)
            out["queue/dropped_total"] = float(train.dropped_total)
            out["queue/duplicates_total"] = float(train.duplicates_total)
        out["cluster/server_restarts"] = float(
            sum(v for k, v in self.restarts.items() if k.startswith("server"))
        )
        out["cluster/trainer_restarts"] = float(self.restarts.get("trainer", 0))
        return out

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop every part this run started (idempotent); each stop has a timeout, then the actor is killed."""
        if self._closed:
            return
        self._closed = True
        import ray

        if self.stop_on_sigterm:  # a second `kill` must not cut the clean-up short (each stop has a timeout)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

        timeout = self.cfg.cluster.shutdown_timeout_s
        steps: list[tuple[str, list[Any], str | None]] = [
            ("rollouter", [self.rollouter] if self.rollouter else [], "stop"),
            ("trainer", self.ranks, "close"),
            # A host still starting (or waiting for room after its node died) cannot answer `stop`: killed.
            ("servers", [h for i, h in enumerate(self.hosts) if i not in self._restarting], "stop"),
            ("restarting servers", [self.hosts[i] for i in self._restarting], None),
            ("queue", [self.queue_actor] if self.queue_actor else [], "stop"),
        ]
        for name, actors, method in steps:
            if not actors:
                continue
            try:
                if method is not None:
                    ray.get([getattr(a, method).remote() for a in actors], timeout=timeout)
            except Exception as err:
                log.warning("stopping the %s: %s; killing it", name, _first_line(err))
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    pass
        if self.queue_client is not None:
            self.queue_client.close()
        if self.logger is not None:
            self.logger.close()
        if self.placement is not None:
            self.placement.release()
        if self._ray_started:
            ray.shutdown()
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)

    # ------------------------------------------------------------------ helpers
    def _get(self, refs: Any, timeout_s: float, what: str) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise PartFailed(f"{what}: no answer within {timeout_s:.0f} s") from err
        except ray.exceptions.RayActorError as err:
            raise PartFailed(f"{what} died: {_first_line(err)}{self._lost_note()}") from err
        except ray.exceptions.RayTaskError as err:
            raise PartFailed(f"{what} failed: {err.cause if err.cause is not None else err}") from err

    def _lost_note(self) -> str:
        """``; node X holding a, b is gone ...`` for every node of the run Ray lost, else empty."""
        lost = self.placement.lost_nodes() if self.placement is not None else {}
        if not lost:
            return ""
        nodes = "; ".join(f"node {node} (holding {', '.join(parts)})" for node, parts in lost.items())
        return (
            f". Lost: {nodes}. Start a replacement node (scripts/launch_*_cluster.sh) and run the same command "
            "again: run.resume continues from the latest checkpoint"
        )


def connect_ray(cfg: Config) -> bool:
    """Join ``cluster.ray_address``, or start Ray on this machine with both pools sized from its GPUs;
    return whether this call started it (then the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    from slipstream.pipeline.placement import local_resources

    # Raylet then kills a crashed actor's child processes too (an inference server), within 10 s.
    os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "1")
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if cfg.cluster.ray_address is not None:
        send_ray_token_if_any()
    if cfg.cluster.ray_address is None:
        gpus = local_gpus()
        kwargs.update(num_gpus=gpus, resources=local_resources(cfg, gpus))
    # "local" starts a new instance: with no address, ray.init() would join any cluster that `ray start`
    # left running on this machine (and then refuse the pool resources).
    ray.init(address=cfg.cluster.ray_address or "local", **kwargs)
    return True


def send_ray_token_if_any() -> None:
    """Send this machine's Ray token when joining a cluster (as scripts/_ray_env.sh does for the nodes).

    A Ray head that finds a token (~/.ray/auth_token, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) requires it, but a
    driver joining it only sends one with RAY_AUTH_MODE=token, and fails with a bare "Failed to connect".
    RAY_AUTH_MODE set by hand wins."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    tokens = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    if any(os.environ.get(k) for k in tokens) or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def local_gpus() -> int:
    """GPUs this machine shows the run (CUDA_VISIBLE_DEVICES applies), 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_pools(cfg: Config, resources: dict[str, float]) -> None:
    """Both pool resources exist in the cluster (the launch scripts declare them)."""
    for key in ("rollout_resource", "trainer_resource"):
        name = getattr(cfg.cluster, key)
        if name not in resources:
            raise ConfigError(
                f"cluster.{key}: the Ray cluster has no `{name}` resource; start its nodes with "
                "scripts/launch_rollout_cluster.sh / scripts/launch_trainer_cluster.sh"
            )


def check_hosts(cfg: Config, nodes: int) -> None:
    """On two nodes or more no server may bind loopback: one error naming every key to change."""
    from slipstream.utils.net import is_loopback

    if nodes < 2:
        return
    keys = [
        f"{key}={host}"
        for key, host in (
            ("queue.host", cfg.queue.host),
            ("cluster.server_host", cfg.cluster.server_host),
            ("weightsync.master_address", cfg.weightsync.master_address),
        )
        if is_loopback(host)
    ]
    if keys:
        fix = " ".join(f"{k.split('=')[0]}=0.0.0.0" for k in keys)
        raise ConfigError(
            f"{', '.join(k.split('=')[0] for k in keys)}: loopback ({', '.join(keys)}) but the Ray cluster has "
            f"{nodes} nodes, so other nodes could not reach them; set {fix}"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _yaml(cfg: Config) -> str:
    from slipstream.config import to_yaml

    return to_yaml(cfg)


__all__ = ["PartFailed", "Pipeline", "RunResult"]
