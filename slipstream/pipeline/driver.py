"""The step driver: one trainer step on every rank, the weight push that follows every ``sync_every``
steps, and the step's metrics record.

Each step: every rank runs ``step()`` (rank 0 leases a batch, all train, rank 0 acks) while the
supervisor watches health; every ``async.sync_every`` steps the rollouter is drained first
(``partial_rollout: off``), the ranks push the new version and the rollouter is told (``set_version``
opens the staleness gate); every ``trainer.checkpoint_every`` steps the checkpoint coordinator saves; then
one record of metrics (the trainer's, idle ratio and throughput, the push's, the queue's and the
rollouter's). With ``async.autotune`` on, the controller (pipeline/autotune.py) reads that record; a decision
that moves ``async.staleness_threshold`` goes to the rollouter's gate, and its ``autotune/*`` keys and reason
join the record and the log. The pipeline moves only the threshold: ``sync_every`` and the concurrency stay
as configured (the trainer ranks and the rollout client are built with them).

A rank that dies during a step or a push raises :class:`~slipstream.pipeline.cluster.TrainerDied`; the
``Pipeline`` hands it to the supervisor, which restarts the ranks or ends the run.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from slipstream.config import Config, rollouter_settings
from slipstream.pipeline import checkpoint as ckpt
from slipstream.pipeline.autotune import Autotuner, Knobs, Observation
from slipstream.pipeline.checkpoint import CheckpointCoordinator
from slipstream.pipeline.cluster import (
    CALL_TIMEOUT_S,
    ActorDied,
    CallFailed,
    Cluster,
    PartFailed,
    Pending,
    TrainerDied,
    first_line,
)
from slipstream.pipeline.parts import Parts
from slipstream.pipeline.supervisor import Supervisor
from slipstream.pipeline.types import PushReport, StepReport
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class StepDriver:
    """Runs steps and pushes (module docstring); ``t0`` is the run's start, for ``perf/elapsed_s``."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        parts: Parts,
        supervisor: Supervisor,
        checkpoints: CheckpointCoordinator,
        *,
        total_steps: int,
        t0: float,
    ) -> None:
        self.cfg, self.cluster, self.parts = cfg, cluster, parts
        self.supervisor, self.checkpoints = supervisor, checkpoints
        self.total_steps = total_steps
        self.t0 = t0
        self.last_step_end = time.monotonic()
        self.autotune = make_autotuner(cfg)
        checkpoints.autotune = self.autotune

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        """Train one step on every rank, push and checkpoint when due; return the step's metrics."""
        return self._after_step(self._run_step())

    def _run_step(self) -> list[StepReport]:
        calls = self.parts.trainer.step()
        results: dict[Pending[StepReport], StepReport] = {}
        deadline = time.monotonic() + self.cfg.cluster.step_timeout_s
        pending = list(calls)
        while pending:
            wait_s = max(0.0, min(self.cfg.cluster.health_interval_s, deadline - time.monotonic()))
            ready, pending = self.cluster.wait(pending, wait_s)
            for call in ready:  # at once: a dead rank leaves the others blocked in a collective
                results[call] = self.rank_result(call)
            if pending:
                if time.monotonic() >= deadline:
                    raise PartFailed(
                        f"trainer step {self.parts.version + 1} did not finish within cluster.step_timeout_s="
                        f"{self.cfg.cluster.step_timeout_s:.0f} s"
                    )
                self.supervisor.watch()
        self.supervisor.watch()  # also when steps are shorter than the health interval
        return [results[c] for c in calls]

    def rank_result(self, call: Pending[StepReport]) -> StepReport:
        """One rank's step report; a dead rank (or, with ``cluster.restart_trainer``, a failed step) is a
        :class:`TrainerDied`."""
        try:
            return self.cluster.get(call, CALL_TIMEOUT_S)
        except ActorDied as err:
            raise TrainerDied(f"a trainer rank died: {first_line(err)}") from err
        except CallFailed as err:
            if self.cfg.cluster.restart_trainer:
                raise TrainerDied(f"a trainer step failed: {first_line(err)}") from err
            raise PartFailed(f"trainer step {self.parts.version + 1} failed: {err}") from err

    def _after_step(self, results: list[StepReport]) -> dict[str, float]:
        now = time.monotonic()
        head = results[0]
        self.parts.version = version = head.version
        window = max(now - self.last_step_end, 1e-9)
        metrics = dict(head.metrics)
        metrics["trainer/idle_ratio"] = min(1.0, head.lease_wait_s / window)
        metrics["time/trainer_wait_s"] = head.lease_wait_s
        metrics["time/trainer_compute_s"] = max(0.0, metrics.get("trainer/step_s", 0.0) - head.lease_wait_s)
        metrics["perf/step_wall_s"] = window
        metrics["perf/samples_per_s"] = metrics.get("trainer/samples", 0.0) / window
        metrics["perf/trained_tokens_per_s"] = metrics.get("trainer/tokens", 0.0) / window
        metrics["perf/elapsed_s"] = now - self.t0
        if self.cfg.run.record_uids:
            ckpt.record_uids(self.checkpoints.run_dir, version, head.uids)
        if version % self.cfg.async_.sync_every == 0:
            metrics.update(self.push(version))
        every = self.cfg.trainer.checkpoint_every
        if every and version % every == 0:
            metrics.update(self.checkpoints.save(version))
        if version >= self.total_steps and self.cfg.eval_.every > 0:
            # The last record carries the evaluation of the weights the run ends with.
            self.parts.rollouter.finish_eval(self.parts.published, self.cfg.cluster.step_timeout_s)
        metrics.update(self._side_metrics())
        if self.autotune is not None:
            metrics.update(self._autotune(version, metrics))
        self.last_step_end = time.monotonic()
        metrics.update(step_time_split(metrics, self.last_step_end - (now - window)))
        return metrics

    # ------------------------------------------------------------------ weights
    def push(self, version: int) -> dict[str, float]:
        """Push ``version`` to every server and open the rollouter's gate for it."""
        parts = self.parts
        if version <= parts.published:
            # A restarted trainer replays steps the servers already have newer weights for.
            return {"sync/skipped": 1.0}
        t0 = time.monotonic()
        out: dict[str, float] = {}
        started = parts.rollouter_started  # a first push on resume comes before the rollouter starts
        if self.cfg.async_.partial_rollout == "off" and started:
            out["sync/drain_s"] = float(parts.rollouter.drain(self._drain_timeout_s()))
        report: PushReport = parts.trainer.publish(version, 4 * self.cfg.weightsync.timeout_s + 60)
        parts.published = version
        if started:
            parts.rollouter.set_version(version)
        self.supervisor.joined_after_push(report, version)
        if report.failed:
            log.warning("version %d did not reach %s", version, ", ".join(report.failed))
        out.update({
            "sync/publish_s": time.monotonic() - t0,
            "sync/version": float(version),
            "sync/servers_ok": float(len(report.ok)),
            "sync/servers_failed": float(len(report.failed)),
            "sync/bytes": float(report.publish.bytes if report.publish is not None else 0),
            # the servers generated nothing for this long (the whole push on a server paused before it)
            "sync/paused_s": report.publish.paused_s if report.publish is not None else 0.0,
            # refusals for bytes that failed verification (weightsync.verify): corruption on the way
            "sync/verify_failed": float(report.publish.verify_failed if report.publish is not None else 0),
            # the trainer's share of verification: digesting what it sent
            "sync/verify_s": report.publish.verify_s if report.publish is not None else 0.0,
        })  # fmt: skip
        return out

    # ------------------------------------------------------------------ metrics
    def _side_metrics(self) -> dict[str, float]:
        out = dict(self.parts.rollouter.metrics())
        stats = self.parts.queue_client.stats()
        train = stats.partitions.get("train")
        out["queue/held_groups"] = float(stats.held_groups)
        if train is not None:
            out["queue/ready_groups"] = float(train.ready_groups)
            out["queue/put_total"] = float(train.put_total)
            out["queue/acked_total"] = float(train.acked_total)
            out["queue/dropped_total"] = float(train.dropped_total)
            out["queue/duplicates_total"] = float(train.duplicates_total)
        restarts = self.supervisor.restarts
        out["cluster/server_restarts"] = float(sum(v for k, v in restarts.items() if k.startswith("server")))
        out["cluster/trainer_restarts"] = float(restarts.get("trainer", 0))
        return out

    def _autotune(self, version: int, metrics: dict[str, float]) -> dict[str, float]:
        """One step's record to the controller; a decision that moves the threshold goes to the rollouter."""
        assert self.autotune is not None
        decision = self.autotune.observe(Observation.from_metrics(metrics))
        if decision is None:
            return {}
        if decision.changed:
            self.parts.rollouter.set_staleness_threshold(decision.knobs.staleness_threshold)
            log.info("autotune at step %d: %s", version, decision.reason)
        elif decision.reason.startswith("hold: missing"):
            log.warning("autotune at step %d: %s", version, decision.reason)
        return decision.metrics()

    def resume_autotune(self, checkpoint: Path | None) -> None:
        """A resumed run: the controller goes on from the state saved in ``checkpoint`` and the rollouter
        takes its threshold (it started with the configured one)."""
        state = ckpt.read_autotune_state(checkpoint) if checkpoint is not None else None
        if self.autotune is None or state is None:
            return
        self.autotune.state = state
        self.parts.rollouter.set_staleness_threshold(state.knobs.staleness_threshold)
        log.info("autotune resumed at %s", state.knobs.describe())

    def _drain_timeout_s(self) -> float:
        """How long the controller waits for a drain: the rollouter's own bound, plus a minute for the call."""
        return rollouter_settings(self.cfg).drain_timeout_s + 60


def make_autotuner(cfg: Config) -> Autotuner | None:
    """The controller of ``async.autotune`` (None when off), its ``sync_every`` and concurrency pinned to the
    config's: the pipeline moves only the threshold (module docstring)."""
    a = cfg.async_
    if a.autotune == "off":
        return None
    conc = cfg.rollout.max_concurrent_per_server
    bounds = msgspec.structs.replace(a.autotune_bounds, sync_every_min=a.sync_every, sync_every_max=a.sync_every,
                                     concurrency_min=conc, concurrency_max=conc)  # fmt: skip
    start = Knobs(staleness_threshold=a.staleness_threshold, sync_every=a.sync_every, concurrency=conc)
    return Autotuner(
        bounds, every=a.autotune_every, start=start, max_staleness=a.max_staleness, group_size=cfg.rollout.n
    )


def step_time_split(metrics: dict[str, float], wall_s: float) -> dict[str, float]:
    """Where a step's wall time went, from the trainer's side (``time/*``, each in seconds): waiting for a
    batch (the rollouter was behind), computing, pushing the new version (of which the servers were paused
    ``time/servers_paused_s``), and the rest (checkpoints, evaluation, metrics). Generation overlaps all of
    them; how fast it ran is ``server/*`` (each server's own counters) and ``rollouter/*``."""
    wait = metrics.get("time/trainer_wait_s", 0.0)
    compute = metrics.get("time/trainer_compute_s", 0.0)
    push = metrics.get("sync/publish_s", 0.0)
    return {
        "time/step_s": wall_s,
        "time/push_s": push,
        "time/servers_paused_s": metrics.get("sync/paused_s", 0.0),
        "time/other_s": max(0.0, wall_s - wait - compute - push),
    }


__all__ = ["StepDriver", "make_autotuner", "step_time_split"]
