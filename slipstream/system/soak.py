"""``slipstream bench soak``: a long fully asynchronous run with inference servers and trainer ranks killed
on a schedule, reporting memory per process and whether any prompt group was lost or trained twice.

The workload is the quickstart's (``configs/quickstart.yaml``: SmolLM2-135M-Instruct, one embedded CPU
server, FSDP over gloo), cycling over its prompts for as many epochs as the run lasts (a uid names its epoch,
``e<epoch>-p<index>[-a<attempt>]-<sample>``, so it stays unique however long the run). The soak adds what
recovery needs: ``cluster.restart_servers`` and ``cluster.restart_trainer`` on, restarts unlimited in
practice, a checkpoint every ``trainer.checkpoint_every`` (5) steps to restart the trainer from, and
``run.record_uids`` (the per-step record of trained uids). ``key=value`` overrides apply last.

Kills land at states, never at random times: the plan acts in the pipeline's ``on_step`` hook, after a
step, its weight push and its checkpoint are done. It SIGKILLs, in turn, an inference server process (the
pid its own host actor reports) and a trainer rank process (the pid the rank reports), waits until the
process is gone, and does nothing more until the run has recovered: a killed server is back in service
(restarted and at the current weights: a later push reached every server), a killed trainer was restarted
from its checkpoint and a step has completed since. The next kill comes ``--kill-every`` steps after that.
The soak stops at the first step after ``--minutes`` at which no kill is recovering (or ``--grace-minutes``
later regardless), or as soon as ``--kills`` kills have recovered; it stops as ``slipstream train`` does on
SIGTERM: the step in flight, then a checkpoint.

Memory: the resident set (psutil) of each process, keyed by role (``driver``, ``queue``, ``rollouter``,
``server-<i>``, ``trainer-<rank>``), after ``--warmup-steps`` steps (3: models loaded, optimizer state made,
the allocators at their working size) and after the last step, and its peak over every step;
``<run_dir>/soak_rss.jsonl`` has one sample per step (no kill comes before the start sample). A restarted
server or trainer rank is a new process, so its end figure covers only its own life; the driver, the queue
server and the rollouter live through the whole run.

Losses and duplicates are counted from ground truth at the end, from the run's final checkpoint (the one the
stop writes):

* admitted: every prompt the rollouter took from its prompt source, i.e. the first ``position`` prompts of
  the source's order, which depends only on the files, the seed and the epoch (``agents/data.py``), with the
  position read from the checkpoint's rollouter state;
* trained: every uid of ``trained_uids.jsonl`` over the run's final history of steps (after a trainer
  restart the replayed steps replace the rolled-back ones: the last record of a step counts);
* still owed: groups in the queue snapshot (ready, leased, or dropped as too stale and not yet regenerated)
  and prompts the rollouter state owes (in flight, waiting to be generated again).

A group is lost when its prompt was admitted but neither trained nor owed (the count assumes
``rollout.dynamic_sampling`` off, as in the quickstart: a prompt it skips would count as lost); duplicated
when its prompt was trained under two group ids (two attempts), any of its uids appears in two trained
samples, or it is trained and still waits in the queue. ``groups_partial`` counts trained groups with fewer
samples than ``rollout.n``.

The last line of ``--json`` is one JSON object: ``{"minutes", "rss_mb_start", "rss_mb_end", "rss_mb_peak",
"groups_lost", "groups_duplicated", "restarts", "kills", "steps", "samples_trained", ...}``.

Example::

    slipstream bench soak --minutes 60 --json
    slipstream bench soak --kills 2 --kill-every 2 --out /tmp/s model.path=/tmp/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.cli_args import add_json_flag, command_parser, doc_paragraph

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
RSS_FILE = "soak_rss.jsonl"
# Epochs over the prompts: more than any soak can use (a uid names its epoch, so they never repeat).
EPOCHS = 100_000
_GROUP = re.compile(r"^e(\d+)-p(\d+)(?:-a\d+)?$")


def _parser() -> argparse.ArgumentParser:
    p = command_parser("slipstream bench soak", doc_paragraph(__doc__))
    # Hand-written: the kill schedule is the bench's own; config keys come as the positional overrides.
    p.add_argument("--config", default=str(QUICKSTART), help="base preset (default: configs/quickstart.yaml)")
    p.add_argument("--minutes", type=float, default=60.0, help="stop at the first settled step after this")
    p.add_argument(
        "--kills", type=int, default=0, help="stop once this many kills have recovered (0: no limit)"
    )
    p.add_argument("--kill-every", type=int, default=8, help="steps between a recovery and the next kill")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="steps before the start sample of memory (models loaded, "
        "optimizer state made, the allocator at its working size)",
    )
    p.add_argument("--first", choices=("server", "trainer"), default="server", help="the first kill's kind")
    p.add_argument(
        "--grace-minutes",
        type=float,
        default=15.0,
        help="past --minutes, stop even while a kill is recovering",
    )
    p.add_argument("--out", help="the run directory goes here (default: a temporary directory)")
    add_json_flag(p)
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, applied last")
    return p


def soak_overrides(out: Path) -> list[str]:
    """What the soak sets on top of the preset (the user's overrides come after and win)."""
    return [
        "async.mode=fully_async",
        "rollout.backend=embedded",  # the soak kills and restarts embedded servers (seconds to start)
        "run.name=soak",
        f"run.output_dir={out}",
        "run.resume=false",
        "run.record_uids=true",
        "run.total_steps=0",  # one pass over all epochs: the soak's own plan stops the run
        f"data.epochs={EPOCHS}",
        "trainer.checkpoint_every=5",
        "cluster.restart_servers=true",
        "cluster.restart_trainer=true",
        "cluster.max_restarts=100000",
        "wandb.mode=disabled",
    ]


if TYPE_CHECKING:
    from slipstream.pipeline.controller import Pipeline


# ----------------------------------------------------------------------------------------------- processes
def rss_mb(pid: int | None) -> float | None:
    import psutil

    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped: it holds no memory
            return None
        return round(proc.memory_info().rss / 2**20, 1)
    except psutil.NoSuchProcess:
        return None


def wait_until_gone(pid: int) -> None:
    """Block until process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        while proc.status() != psutil.STATUS_ZOMBIE:
            try:
                proc.wait(timeout=0.1)  # polls: the process is another process's child
            except psutil.TimeoutExpired:
                continue
    except psutil.NoSuchProcess:
        pass


class Processes:
    """The pid of each process of a run, keyed by role; the long-lived ones are asked once."""

    def __init__(self) -> None:
        self._fixed: dict[str, int] = {}

    def pids(self, pipeline: Pipeline) -> dict[str, int | None]:
        parts = pipeline.parts
        if not self._fixed:
            self._fixed["driver"] = os.getpid()
            self._fixed["queue"] = parts.queue.pid()
            self._fixed["rollouter"] = parts.rollouter.pid()
        out: dict[str, int | None] = dict(self._fixed)
        out.update({f"server-{i}": host.pid() for i, host in enumerate(parts.servers.hosts())})
        out.update({f"trainer-{r}": pid for r, pid in enumerate(parts.trainer.pids())})
        return out


# ----------------------------------------------------------------------------------------------- the plan
@dataclass
class Kill:
    kind: str  # "server" | "trainer"
    target: int  # server index or trainer rank
    pid: int
    step: int  # the trainer version after which it happened
    at_s: float  # seconds since the soak began
    restarts_before: int
    recovered_step: int | None = None
    recovery_s: float | None = None


@dataclass
class SoakPlan:
    """The ``on_step`` hook of a soak: samples memory, kills, waits for recovery, stops (module docstring)."""

    minutes: float
    kills: int = 0  # 0: until the deadline
    kill_every: int = 8
    warmup_steps: int = 3
    first: str = "server"
    grace_minutes: float = 15.0
    t0: float = field(default_factory=time.monotonic)
    done: list[Kill] = field(default_factory=list)
    pending: Kill | None = None
    steps_run: int = 0  # on_step calls: steps replayed after a trainer restart count again
    quiet_steps: int = 0  # steps since the last recovery (or the start)
    stopping: bool = False
    stop_reason: str = ""
    rss_start: dict[str, float | None] = field(default_factory=dict)
    rss_end: dict[str, float | None] = field(default_factory=dict)
    rss_peak: dict[str, float] = field(default_factory=dict)
    pids_start: dict[str, int | None] = field(default_factory=dict)
    pids_end: dict[str, int | None] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    procs: Processes = field(default_factory=Processes)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, pipeline: Any, version: int, metrics: dict[str, float]) -> None:
        self.steps_run += 1
        self.last_metrics = dict(metrics)
        self._sample(pipeline, version)
        if self.stopping:
            return
        if self.pending is not None and self._recovered(pipeline, metrics):
            self.pending.recovered_step = version
            self.pending.recovery_s = round(self.elapsed() - self.pending.at_s, 1)
            self.done.append(self.pending)
            self.pending, self.quiet_steps = None, 0
        elif self.pending is None:
            self.quiet_steps += 1
        reason = self._stop_reason()
        if reason:
            self.stopping, self.stop_reason = True, reason
            pipeline.request_stop()
        elif self.pending is None and self.rss_start and self.quiet_steps >= self.kill_every:
            self._kill(pipeline, version)

    # -------------------------------------------------------------- memory
    def _sample(self, pipeline: Any, version: int) -> None:
        pids = self.procs.pids(pipeline)
        rss = {role: rss_mb(pid) for role, pid in pids.items()}
        if not self.rss_start and self.steps_run >= self.warmup_steps:
            self.rss_start, self.pids_start = dict(rss), dict(pids)
        self.rss_end, self.pids_end = rss, pids
        for role, mb in rss.items():
            if mb is not None:
                self.rss_peak[role] = max(mb, self.rss_peak.get(role, 0.0))
        record = {"step": version, "elapsed_s": round(self.elapsed(), 1), "rss_mb": rss, "pids": pids}
        with (Path(pipeline.run_dir) / RSS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    # -------------------------------------------------------------- kills
    def _stop_reason(self) -> str:
        if self.kills and len(self.done) >= self.kills:
            return f"{len(self.done)} kills done"
        past = self.elapsed() - self.minutes * 60.0
        if past >= 0 and self.pending is None:
            return f"{self.minutes:g} minutes"
        if past >= self.grace_minutes * 60.0:
            return f"{self.minutes:g} minutes and {self.grace_minutes:g} of grace (a kill still recovering)"
        return ""

    def _next_kind(self) -> str:
        other = "trainer" if self.first == "server" else "server"
        return self.first if len(self.done) % 2 == 0 else other

    def _kill(self, pipeline: Pipeline, version: int) -> None:
        from slipstream.trainer.trainer import latest_checkpoint

        kind = self._next_kind()
        nth = sum(1 for k in self.done if k.kind == kind)
        pid: int | None
        if kind == "server":
            hosts = pipeline.parts.servers.hosts()
            if not hosts or pipeline.servers_restarting:
                return  # servers given by URL are not the run's to kill; a restart is still going on
            target = nth % len(hosts)
            pid = hosts[target].pid()
            before = pipeline.restarts.get(f"server-{target}", 0)
        else:
            if latest_checkpoint(pipeline.ckpt_root) is None:
                return  # nothing to restart from yet: the next step looks again
            ranks = pipeline.parts.trainer.pids()
            target = nth % len(ranks)
            pid = ranks[target]
            before = pipeline.restarts.get("trainer", 0)
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        wait_until_gone(pid)  # the next step finds it dead, on a fast machine as on a slow one
        self.pending = Kill(kind, target, pid, version, round(self.elapsed(), 1), before)
        print(f"soak: killed {kind} {target} (pid {pid}) after step {version}", file=sys.stderr, flush=True)

    def _recovered(self, pipeline: Pipeline, metrics: dict[str, float]) -> bool:
        kill = self.pending
        if kill.kind == "trainer":  # a step completed after the restart (on_step runs after steps only)
            return pipeline.restarts.get("trainer", 0) > kill.restarts_before
        restarted = pipeline.restarts.get(f"server-{kill.target}", 0) > kill.restarts_before
        back = kill.target not in pipeline.servers_restarting
        # Serving again: this step's push reached every server, the restarted one included.
        servers = len(pipeline.parts.servers.hosts())
        return restarted and back and metrics.get("sync/servers_ok", -1.0) == float(servers)


# ----------------------------------------------------------------------------------------------- accounting
def _prompt_key(group_id: str) -> tuple[int, int] | None:
    """``e3-p7`` or ``e3-p7-a1`` -> (3, 7): the prompt, whatever the attempt."""
    m = _GROUP.match(group_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _group_of(uid: str) -> str:
    return uid.rsplit("-", 1)[0]


def account(cfg: Any, run_dir: Path, version: int) -> dict[str, Any]:
    """Lost and duplicated groups of a finished run, from its final checkpoint (module docstring)."""
    from slipstream.agents.data import PromptSource
    from slipstream.pipeline.checkpoint import checkpoint_root, read_rollouter_state, read_trained_uids
    from slipstream.queue.snapdir import SnapshotDir
    from slipstream.queue.snapshot import MAGIC, read_snapshot
    from slipstream.trainer.trainer import latest_checkpoint

    final = latest_checkpoint(checkpoint_root(run_dir))
    if final is None or int(final.name.rsplit("_", 1)[1]) != version:
        raise RuntimeError(f"no checkpoint of the final version {version} in {run_dir}: cannot account")
    state = read_rollouter_state(final)
    header, _ = read_snapshot(SnapshotDir(str(checkpoint_root(run_dir)), MAGIC), f"{final.name}/queue")

    source = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    position = state.prompts.epoch * len(source.samples) + state.prompts.offset if state else 0
    admitted = set()
    for _ in range(position):
        ref, _sample = source.next()
        admitted.add((ref.epoch, ref.index))

    trained_uids = [u for step, uids in read_trained_uids(run_dir).items() if step <= version for u in uids]
    uid_counts = Counter(trained_uids)
    groups: dict[str, int] = Counter(_group_of(u) for u in trained_uids)
    by_prompt: dict[tuple[int, int], set[str]] = defaultdict(set)
    for gid in groups:
        key = _prompt_key(gid)
        by_prompt[key if key is not None else (-1, -1)].add(gid)

    queued = {g.meta.group_id for g in header.groups}
    owed = {_prompt_key(gid) for gid in queued} | {_prompt_key(m.group_id) for m in header.dropped}
    owed |= {(p.epoch, p.index) for p in (state.pending if state else [])}

    dup_prompts = {key for key, gids in by_prompt.items() if len(gids) > 1}
    dup_prompts |= {_prompt_key(_group_of(u)) for u, c in uid_counts.items() if c > 1}
    dup_prompts |= {_prompt_key(gid) for gid in groups if gid in queued}
    lost = admitted - set(by_prompt) - owed
    return {
        "groups_lost": len(lost),
        "groups_duplicated": len(dup_prompts),
        "groups_admitted": len(admitted),
        "groups_trained": len(groups),
        "groups_owed_at_end": len(owed & admitted),
        "groups_unexpected": len(set(by_prompt) - admitted),  # trained but never admitted: a bad record
        "groups_partial": sum(1 for c in groups.values() if c != cfg.rollout.n),
        "samples_trained": len(trained_uids),
        "samples_duplicated": sum(c - 1 for c in uid_counts.values() if c > 1),
        "lost_examples": sorted(f"e{e}-p{i}" for e, i in lost)[:10],
        "final_checkpoint": str(final),
    }


# ----------------------------------------------------------------------------------------------- running
def run_soak(cfg: Any, plan: SoakPlan, *, reap_if_killed: bool = False) -> dict[str, Any]:
    """Run the pipeline under ``plan`` and return the report (module docstring)."""
    from slipstream.pipeline import Pipeline

    pipeline = Pipeline(cfg, on_step=plan)
    pipeline.reap_if_killed = reap_if_killed
    plan.t0 = time.monotonic()
    result = pipeline.run()
    report: dict[str, Any] = {
        "minutes": round(plan.elapsed() / 60.0, 2),
        "rss_mb_start": plan.rss_start,
        "rss_mb_end": plan.rss_end,
        "rss_mb_peak": plan.rss_peak,
        "restarts": dict(result.restarts),
        "kills_done": len(plan.done),
        # Restarts no kill of the plan caused (a part that died on its own, e.g. killed for memory).
        "unplanned_restarts": sum(result.restarts.values()) - len(plan.done) - (plan.pending is not None),
        "kills": [vars(k) for k in plan.done + ([plan.pending] if plan.pending else [])],
        "steps": result.version,
        "steps_run": plan.steps_run,
        "stop_reason": plan.stop_reason,
        "restarted_roles": sorted(r for r, p in plan.pids_end.items() if plan.pids_start.get(r) != p),
    }
    report.update(account(pipeline.cfg, result.run_dir, result.version))
    for key in ("queue/duplicates_total", "queue/dropped_total", "queue/put_total", "queue/acked_total"):
        if key in plan.last_metrics:
            report[key.replace("/", "_")] = plan.last_metrics[key]
    report["run_dir"] = str(result.run_dir)
    report["wall_s"] = round(result.wall_s, 1)
    return report


def main(argv: list[str]) -> int:
    from slipstream.config import ConfigError, load_config
    from slipstream.pipeline import PartFailed

    args = _parser().parse_intermixed_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="slipstream-soak-"))
    try:
        cfg = load_config(args.config, [*soak_overrides(out), *args.overrides])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    plan = SoakPlan(
        args.minutes,
        args.kills,
        args.kill_every,
        args.warmup_steps,
        args.first,
        args.grace_minutes,
    )
    try:
        report = run_soak(cfg, plan, reap_if_killed=True)
    except PartFailed as err:
        print(f"slipstream bench soak: {err}", file=sys.stderr)
        return 1
    report["minutes_requested"] = args.minutes
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")
    clean = report["groups_lost"] == 0 and report["groups_duplicated"] == 0
    return 0 if clean else 1
