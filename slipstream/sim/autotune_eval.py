"""`slipstream simulate --autotune-eval [--json] [--steps N] [--workloads a,b]`: the autotune controller
(``pipeline/autotune.py``) against every static setting of its knobs, in the simulator.

Each workload is a profile and a config (:data:`WORKLOADS`; 4 servers, 8 groups of 8 per step), with the
hard cap ``async.max_staleness`` at the controller's ``staleness_cap`` (2), as ``prepare_config`` sets it when
the controller runs: a group over it is dropped, never trained, by the controller and every static alike.
On each:

* **the controller** starts from a poor setting (:data:`POOR_START`: threshold 0, ``sync_every`` 1, 4
  requests per server) and decides every ``EVERY`` steps from the step metrics the simulator reports under
  the run's own keys; its decisions are applied mid-run (:meth:`Simulation.set_knobs`);
* **every static setting** of the grid (:func:`static_grid`: the controller's threshold ladder up to the
  bound, every ``sync_every`` in the bounds, concurrency 4 to 64) runs the same steps; the best static is
  the one with the most trained tokens/s among those that kept every trained group within the staleness
  cap.

Figures (the goals are issue 33's):

* ``min_ratio_vs_best_static``: the controller's trained tokens/s over the best static setting's,
  minimum over the workloads (goal >= 0.9);
* ``bound_violations``: steps, over all workloads, whose trained groups went over the staleness cap
  (goal 0);
* ``max_setting_changes_steady``: knob changes in the second half of a run, the workload steady (all but
  ``growing`` and ``server_lost``), maximum over those workloads (goal <= 2);
* ``workloads``: per workload, the controller's tokens/s, the best static's and its setting, the ratio,
  the controller's final setting and its decisions that changed something (step and reason).

Worked example::

    slipstream simulate --autotune-eval --json | jq .min_ratio_vs_best_static
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slipstream.cli_args import JSON_OBJECT, add_json_flag, command_parser, doc_paragraph
from slipstream.config import AutotuneBounds, Config
from slipstream.pipeline.autotune import THRESHOLDS, Autotuner, Knobs, Observation
from slipstream.sim.simulate import SimResult, Simulation, sim_config
from slipstream.sim.types import Profile, parse_profile

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
EVERY = 2
STEPS = 150
BOUNDS = AutotuneBounds(staleness_cap=2, staleness_threshold_max=2.0, sync_every_min=1, sync_every_max=4,
                        concurrency_min=1, concurrency_max=64)  # fmt: skip
POOR_START = Knobs(staleness_threshold=0.0, sync_every=1, concurrency=8)
CONCURRENCY = (4, 8, 16, 32, 64)
BASE = ["rollout.num_servers=4", "trainer.batch_groups=8", "rollout.n=8", "trainer.num_ranks=1",
        "rollout.sampling.max_new_tokens=1024", "async.mode=fully_async", "async.max_staleness=2",
        "async.partial_rollout=abort", "eval.every=0"]  # fmt: skip
# a server decodes up to ~640 tokens/s, saturating past 16-64 requests
_PROFILE: dict[str, Any] = {
    "decode": {"concurrency": [1, 16, 64], "tokens_per_s": [30, 400, 640]},
    "prefill_tokens_per_s": 5000,
    "prompt_tokens": 100,
    "lengths": {"mean": 200, "sigma": 0.5},
    "trainer": {"tokens_per_s_per_rank": 3000, "fixed_s": 1.0},
    "push": {"fixed_s": 1.0},
    "step_overhead_s": 0.2,
}


@dataclass
class Workload:
    name: str
    what: str
    profile: dict[str, Any] = field(default_factory=dict)  # changes to _PROFILE
    overrides: list[str] = field(default_factory=list)
    steady: bool = True
    lose: tuple[int, int] | None = None  # (step server 0 is lost, step it is back)

    def make(self) -> tuple[Config, Profile]:
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in _PROFILE.items()}
        for key, value in self.profile.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        return sim_config(QUICKSTART, [*BASE, *self.overrides]), parse_profile(data)


WORKLOADS = [
    Workload("short", "short responses (mean 200 tokens, sigma 0.5)"),
    Workload("long_tail", "long-tailed responses (mean 300, sigma 1.2)", {"lengths": {"mean": 300, "sigma": 1.2}}),
    Workload("rollout_bound", "a fast trainer: generation is the bottleneck",
             {"trainer": {"tokens_per_s_per_rank": 12000, "fixed_s": 0.5}}),
    Workload("trainer_bound", "a slow trainer: training is the bottleneck",
             {"trainer": {"tokens_per_s_per_rank": 800, "fixed_s": 2.0}}),
    Workload("dynamic_sampling", "dynamic sampling drops 40% of the groups", {"filtered_fraction": 0.4},
             ["rollout.dynamic_sampling.enable=true"]),
    Workload("growing", "responses grow 2% of the first mean per step (200 to 800 tokens)",
             {"lengths": {"mean": 200, "sigma": 0.5, "drift_per_step": 0.02}}, steady=False),
    Workload("server_lost", "one of the 4 servers lost at step 30, back at step 60", steady=False, lose=(30, 60)),
]  # fmt: skip


def with_knobs(cfg: Config, k: Knobs) -> Config:
    a = msgspec.structs.replace(
        cfg.async_, staleness_threshold=k.staleness_threshold, sync_every=k.sync_every
    )
    r = msgspec.structs.replace(cfg.rollout, max_concurrent_per_server=k.concurrency)
    return msgspec.structs.replace(cfg, async_=a, rollout=r)


def static_grid(bounds: AutotuneBounds) -> list[Knobs]:
    return [
        Knobs(staleness_threshold=s, sync_every=e, concurrency=c)
        for s in THRESHOLDS
        if s <= bounds.staleness_threshold_max
        for e in range(bounds.sync_every_min, bounds.sync_every_max + 1)
        for c in CONCURRENCY
        if bounds.concurrency_min <= c <= bounds.concurrency_max
    ]


def _events(w: Workload, sim: Simulation, step: int) -> None:
    if w.lose is not None and step == w.lose[0]:
        sim.lose_server(0)
    if w.lose is not None and step == w.lose[1]:
        sim.restore_server(0)


def run_static(w: Workload, cfg: Config, prof: Profile, knobs: Knobs, steps: int) -> SimResult:
    sim = Simulation(with_knobs(cfg, knobs), prof, steps=steps)
    sim.on_step = lambda s, m: _events(w, s, s.steps_done)
    return sim.run()


def run_controller(
    w: Workload, cfg: Config, prof: Profile, steps: int, bounds: AutotuneBounds = BOUNDS, every: int = EVERY
) -> tuple[SimResult, list[dict[str, Any]], list[Knobs]]:
    """The controller from :data:`POOR_START`: the result, its decisions that changed a knob, and the
    setting each step ran with."""
    tuner = Autotuner(
        bounds,
        every=every,
        start=POOR_START,
        max_staleness=cfg.async_.max_staleness,
        group_size=cfg.rollout.n,
    )
    sim = Simulation(with_knobs(cfg, POOR_START), prof, steps=steps)
    changes: list[dict[str, Any]] = []
    per_step: list[Knobs] = []

    def on_step(s: Simulation, metrics: dict[str, float]) -> None:
        per_step.append(tuner.state.knobs)
        _events(w, s, s.steps_done)
        d = tuner.observe(Observation.from_metrics(metrics))
        if d is not None and d.changed:
            k = d.knobs
            s.set_knobs(staleness_threshold=k.staleness_threshold, sync_every=k.sync_every,
                        concurrency=k.concurrency)  # fmt: skip
            changes.append({"step": s.steps_done, "reason": d.reason})

    sim.on_step = on_step
    res = sim.run()
    per_step.append(tuner.state.knobs)
    return res, changes, per_step


def evaluate(w: Workload, steps: int = STEPS, bounds: AutotuneBounds = BOUNDS) -> dict[str, Any]:
    cfg, prof = w.make()
    cap = bounds.staleness_cap
    best: tuple[float, Knobs] | None = None
    for knobs in static_grid(bounds):
        r = run_static(w, cfg, prof, knobs, steps)
        ok = all(m["trainer/staleness_versions_max"] <= cap for m in r.step_log)
        if ok and (best is None or r.tokens_per_s > best[0]):
            best = (r.tokens_per_s, knobs)
    res, changes, per_step = run_controller(w, cfg, prof, steps, bounds)
    log = res.step_log
    violations = sum(1 for m in log if m["trainer/staleness_versions_max"] > cap)
    half = steps // 2
    late = sum(1 for a, b in zip(per_step[half:], per_step[half + 1 :], strict=False) if a != b)
    best_tps, best_knobs = best if best is not None else (float("nan"), POOR_START)
    return {
        "workload": w.name,
        "what": w.what,
        "controller_tokens_per_s": round(res.tokens_per_s, 1),
        "best_static_tokens_per_s": round(best_tps, 1),
        "ratio": round(res.tokens_per_s / best_tps, 3),
        "best_static": best_knobs.describe(),
        "start": POOR_START.describe(),
        "final": per_step[-1].describe(),
        "bound_violations": violations,
        "changes": len(changes),
        "changes_second_half": late,
        "steady": w.steady,
        "trainer_idle": round(res.trainer_idle_ratio, 3),
        "staleness_versions_max": res.staleness_versions_max,
        "decisions": changes,
    }


def run_eval(names: list[str] | None = None, steps: int = STEPS) -> dict[str, Any]:
    t0 = time.monotonic()
    rows = [evaluate(w, steps) for w in WORKLOADS if names is None or w.name in names]
    steady = [r["changes_second_half"] for r in rows if r["steady"]]
    return {
        "min_ratio_vs_best_static": min(r["ratio"] for r in rows),
        "bound_violations": sum(r["bound_violations"] for r in rows),
        "max_setting_changes_steady": max(steady, default=0),
        "steps": steps,
        "every": EVERY,
        "bounds": msgspec.to_builtins(BOUNDS),
        "seconds": round(time.monotonic() - t0, 1),
        "workloads": rows,
    }


def table(out: dict[str, Any]) -> str:
    heads = ["workload", "ratio", "ctrl tok/s", "best tok/s", "viol", "chg", "late", "best static", "final"]
    lines = [" | ".join(heads)]
    for r in out["workloads"]:
        lines.append(" | ".join(str(x) for x in (
            r["workload"], r["ratio"], r["controller_tokens_per_s"], r["best_static_tokens_per_s"],
            r["bound_violations"], r["changes"], r["changes_second_half"], r["best_static"], r["final"])))  # fmt: skip
    lines.append(
        f"min_ratio_vs_best_static {out['min_ratio_vs_best_static']}  bound_violations {out['bound_violations']}"
        f"  max_setting_changes_steady {out['max_setting_changes_steady']}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = command_parser("slipstream simulate --autotune-eval", doc_paragraph(__doc__, 1))
    # Hand-written: the evaluation's own workloads and length, no config key.
    p.add_argument("--autotune-eval", action="store_true", help="this evaluation")
    p.add_argument("--steps", type=int, default=STEPS, help="simulated trainer steps per run")
    p.add_argument("--workloads", help="comma-separated names (default: all)")
    add_json_flag(p, JSON_OBJECT)
    args = p.parse_args(argv)
    names = args.workloads.split(",") if args.workloads else None
    # server_lost loses a server in each of its runs: the balancer's warning says so every time
    logging.getLogger("slipstream.rollouter.balancer").setLevel(logging.ERROR)
    out = run_eval(names, args.steps)
    print(json.dumps(out) if args.json else table(out))
    return 0
