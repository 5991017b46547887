"""The single controller: start every part of a run, drive the trainer, move weights, watch health, stop.

Control goes through here, data never does (design.md §1). :class:`Pipeline` runs in the driver process
and composes four parts, each with one job, over the actors of ``pipeline/actors.py``:

::

                       Pipeline (run, request_stop, shutdown; what `slipstream train` calls)
          ┌───────────────┬──────────────┴─────┬──────────────────────┐
      Launcher        StepDriver           Supervisor          CheckpointCoordinator
      start-up,       steps, pushes,       health, restart     rollouter state, ranks'
      shutdown        metrics record       policy (servers,    save, rename, prune,
      (launcher.py)   (driver.py)          trainer) (supervisor.py)   resume point (checkpoint.py)
          └──────── typed handles (handles.py: TrainerGroup, RolloutHandle, ───────┘
                    ServerHandle, QueueHandle) over Cluster (cluster.py: spawn/call/get/wait/kill)
                                   RayCluster ── Ray actors: queue, ServerHost x n,
                                                 RolloutWorker, TrainerRank x n
                                   messages: pipeline/types.py Structs

    trainer pool   TrainerRank x trainer.num_ranks (rank 0: queue client + WeightPublisher), the queue
    rollout pool   ServerHost x rollout.num_servers (one inference server process each), RolloutWorker,
                   ServerHost x reward.service.launch.num_servers (judge servers: no pushes, no rollouts)

Start-up: :meth:`Launcher.start_parts <slipstream.pipeline.launcher.Launcher.start_parts>` (the order is
written there). Steps and pushes: ``driver.py``. Health and restarts of servers and trainer ranks:
``supervisor.py`` (of judge servers: ``judges.py``). Checkpoints: ``checkpoint.py``.

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

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slipstream.config import Config
from slipstream.pipeline import checkpoint as ckpt
from slipstream.pipeline.checkpoint import CheckpointCoordinator
from slipstream.pipeline.cluster import Cluster, PartFailed, TrainerDied
from slipstream.pipeline.driver import StepDriver
from slipstream.pipeline.launcher import (
    Launcher,
    check_hosts,
    check_pools,
    connect_ray,
    install_sigterm,
    local_gpus,
    send_ray_token_if_any,
)
from slipstream.pipeline.modes import (
    check_config,
    check_data,
    config_warnings,
    make_missing_data,
    prepare_config,
)
from slipstream.pipeline.parts import Parts
from slipstream.pipeline.supervisor import Supervisor
from slipstream.utils.http_auth import env_token, new_token
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class RunResult:
    version: int
    run_dir: Path
    wall_s: float
    restarts: dict[str, int] = field(default_factory=dict)
    stopped: bool = False  # ended early by a stop request (SIGTERM), after a checkpoint


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
        self.parts = Parts()
        # Servers started by the run get a fresh token; servers given by URL the one they were started with.
        self.server_token = env_token() if cfg.rollout.server_urls else (env_token() or new_token())
        self.launcher = Launcher(cfg, self.run_dir, self.server_token)
        self.cluster: Cluster | None = None
        self.supervisor: Supervisor | None = None
        self.checkpoints: CheckpointCoordinator | None = None
        self.driver: StepDriver | None = None
        self.logger = None
        self._closed = False
        self._t0 = 0.0

    # ------------------------------------------------------------------ what callers and tests see
    @property
    def version(self) -> int:
        return self.parts.version

    @property
    def restarts(self) -> dict[str, int]:
        return self.supervisor.restarts if self.supervisor is not None else {}

    @property
    def placement(self) -> Any:
        """The run's placement (``pipeline/placement.py``) once Ray is up, else None."""
        return getattr(self.cluster, "placement", None)

    @property
    def servers_restarting(self) -> set[int]:
        """Indices of the servers being restarted (not yet back in the balancer)."""
        return self.supervisor.servers_restarting if self.supervisor is not None else set()

    @property
    def servers_without_room(self) -> set[int]:
        """Restarting servers whose node is gone and for which the rollout pool has no room yet."""
        return self.supervisor.servers_without_room if self.supervisor is not None else set()

    def poll_parts(self) -> None:
        """Run the health checks and move server restarts on now (the step loop does this every
        ``cluster.health_interval_s``); for callers of ``on_step`` that wait for a part to come back."""
        self.supervisor.poll()

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        self._t0 = time.monotonic()
        try:
            self._start()
            while self.version < self.total_steps and not self._stop_requested:
                self._step()
            if self.version > 0 and self._end_needs_checkpoint():
                self.checkpoints.save(self.version)  # the end of a run is always resumable; so is a stop
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
        for note in self.notes:
            log.info("%s", note)
        for warning in config_warnings(self.cfg):
            log.warning("%s", warning)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(_yaml(self.cfg))
        self.cluster = self.launcher.connect(reap_if_killed=self.reap_if_killed)
        if self.stop_on_sigterm:  # after ray.init, which installs a handler of its own
            self._sigterm_before = install_sigterm(self.request_stop)
        self._prepare_model()
        self._compose()
        resume = self.checkpoints.resume_point(self.cfg.run.resume)
        state = ckpt.read_rollouter_state(resume) if resume else None
        # Fresh servers serve the model's initial weights as version 0: a resumed run pushes first.
        self.launcher.start_parts(self.parts, resume, state, push=self.driver.push)
        self.driver.resume_autotune(resume)
        from slipstream.metrics import MetricsLogger

        self.logger = MetricsLogger(
            self.run_dir, self.cfg, total_steps=self.total_steps, start_step=self.version
        )
        self.driver.last_step_end = time.monotonic()
        log.info("run %s: all parts up after %.1f s", self.cfg.run.name, time.monotonic() - self._t0)

    def _prepare_model(self) -> None:
        """A known model name becomes its prepared local path, once, for every part."""
        from slipstream.rollouter.models import resolve_model_path

        model_path = str(resolve_model_path(self.cfg.model.path))
        self.cfg = msgspec.structs.replace(
            self.cfg, model=msgspec.structs.replace(self.cfg.model, path=model_path)
        )
        self.launcher.cfg = self.cfg

    def _compose(self) -> None:
        cfg, cluster, parts = self.cfg, self.cluster, self.parts
        self.supervisor = Supervisor(cfg, cluster, parts, self.launcher, run_dir=self.run_dir)
        self.checkpoints = CheckpointCoordinator(
            parts, self.run_dir, keep=cfg.trainer.keep_checkpoints,
            save_timeout_s=cfg.cluster.step_timeout_s,
        )  # fmt: skip
        self.driver = StepDriver(cfg, cluster, parts, self.supervisor, self.checkpoints,
                                 total_steps=self.total_steps, t0=self._t0)  # fmt: skip

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        try:
            metrics = self.driver.step()
        except TrainerDied as err:
            self.supervisor.restart_trainer(str(err))
            self.driver.last_step_end = time.monotonic()
            return
        self.logger.log(self.version, metrics)
        if self.on_step is not None:
            self.on_step(self, self.version, metrics)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop every part this run started (idempotent); each stop has a timeout, then the actor is killed."""
        if self._closed:
            return
        self._closed = True
        if self.stop_on_sigterm:  # a second `kill` must not cut the clean-up short (each stop has a timeout)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.launcher.stop_all(self.parts)
        if self.logger is not None:
            self.logger.close()
        self.launcher.disconnect()
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)


def _yaml(cfg: Config) -> str:
    from slipstream.config import to_yaml

    return to_yaml(cfg)


# Start-up helpers callers import from here (launcher.py holds them).
__all__ = [
    "PartFailed",
    "Pipeline",
    "RunResult",
    "check_hosts",
    "check_pools",
    "connect_ray",
    "local_gpus",
    "send_ray_token_if_any",
]
