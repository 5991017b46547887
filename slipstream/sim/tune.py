"""`slipstream tune CONFIG [key=value ...] (--profile P | --from-run runs/NAME) [--steps N] [--json]`: the
offline tuner.

Which ``async.staleness_threshold``, ``async.sync_every`` and ``rollout.max_concurrent_per_server`` train
fastest on this config's pools while every trained group stays within ``async.autotune_bounds.staleness_cap``
(and ``async.max_staleness``)? Every setting of the grid the autotune controller moves in (its threshold
ladder up to ``staleness_threshold_max``, every ``sync_every`` in the bounds, the concurrency in powers of
two within them) is simulated (:func:`~slipstream.sim.simulate.simulate`, seconds each) with the profile
given or one fitted to a run (``--from-run``, :func:`~slipstream.sim.profile.profile_from_run`), and ranked
as ``slipstream plan`` ranks its candidates (sim/plan.py: within the cap first, then the steady step time).
The pool split is the config's own; ``slipstream plan capacity`` searches splits.

Prints the ranked table and the recommended setting with its predicted trained tokens/s, idle ratios and
staleness; ``--json``: ``{"best", "overrides", "ranked"}``; ``--png``: the same settings as a plot (samples/s
against mean staleness, red crosses over the cap). A run started from the recommended overrides
with ``async.autotune=throughput`` tunes on from there (docs/tuning.md).

Worked example::

    slipstream tune configs/quickstart.yaml --from-run runs/quickstart
    # ... ranked table ...
    # best: async.staleness_threshold=1 async.sync_every=2 rollout.max_concurrent_per_server=64 (1840 tokens/s)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from slipstream.cli_args import (
    JSON_OBJECT,
    add_config_positionals,
    add_json_flag,
    command_parser,
    doc_paragraph,
)
from slipstream.config import Config, ConfigError
from slipstream.pipeline.autotune import THRESHOLDS
from slipstream.sim.plan import Candidate, _key, _run, _table, draw_frontier
from slipstream.sim.profile import ProfileError, load_profile, profile_from_run
from slipstream.sim.simulate import sim_config
from slipstream.sim.types import Profile


def grid(cfg: Config) -> list[tuple[float, int, int]]:
    """(threshold, sync_every, concurrency) of every setting inside ``async.autotune_bounds``."""
    b = cfg.async_.autotune_bounds
    conc, c = set(), b.concurrency_min
    while c <= b.concurrency_max:
        conc.add(c)
        c *= 2
    conc.add(min(max(cfg.rollout.max_concurrent_per_server, b.concurrency_min), b.concurrency_max))
    return [
        (s, e, c)
        for s in THRESHOLDS
        if s <= b.staleness_threshold_max
        for e in range(b.sync_every_min, b.sync_every_max + 1)
        for c in sorted(conc)
    ]


def tune(base: str, overrides: list[str], profile: Profile, *, steps: int = 16) -> list[Candidate]:
    """Every setting of :func:`grid` simulated, ranked best first."""
    cfg = sim_config(base, overrides)
    cap = min(cfg.async_.autotune_bounds.staleness_cap, cfg.async_.max_staleness)
    per_server = cfg.cluster.gpus_per_server or 1
    per_rank = cfg.cluster.gpus_per_trainer_rank or 1
    servers, ranks = cfg.rollout.num_servers, cfg.trainer.num_ranks
    out = []
    for s, e, c in grid(cfg):
        cand = Candidate(servers * per_server, ranks * per_rank, servers, ranks, s, e, c, max_staleness=cap)
        out.append(_run(base, overrides, cand, profile, steps))
    return sorted(out, key=_key)


def predicted(c: Candidate) -> dict[str, Any]:
    r = c.result
    assert r is not None
    return {
        "tokens_per_s": round(r.tokens_per_s, 1),
        "trainer_idle": round(r.trainer_idle_ratio, 3),
        "rollouter_idle": round(r.rollouter_idle_ratio, 3),
        "staleness_versions_mean": round(r.staleness_versions_mean, 3),
        "staleness_versions_max": r.staleness_versions_max,
    }


def main(argv: list[str]) -> int:
    p = command_parser("slipstream tune", doc_paragraph(__doc__, 1))
    add_config_positionals(p)
    # Hand-written: where the rates come from and how long to simulate, no config key.
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="profile YAML (slipstream profile RUN_DIR -o ...)")
    src.add_argument("--from-run", help="a run directory: its profile is fitted first (slipstream profile)")
    p.add_argument("--steps", type=int, default=16, help="simulated trainer steps per setting")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--png", help="draw the table here: samples/s against mean staleness (sim/plan.py's plot)")
    add_json_flag(p, JSON_OBJECT)
    args = p.parse_args(argv)
    try:
        profile = load_profile(args.profile) if args.profile else profile_from_run(args.from_run)
        ranked = tune(args.config, args.overrides, profile, steps=args.steps)
    except (ConfigError, ProfileError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    best = ranked[0]
    if args.png:
        draw_frontier(ranked, args.png)
    knobs = [o for o in best.overrides() if o.startswith(("async.staleness", "async.sync", "rollout.max"))]
    if args.json:
        print(json.dumps({"best": {**best.row(), **predicted(best)}, "overrides": knobs,
                          "ranked": [{**c.row(), **predicted(c)} for c in ranked]}))  # fmt: skip
        return 0
    print(_table([c.row() for c in ranked[: args.top]]))
    if not best.within_cap:
        print("no setting kept staleness within the cap; the fastest is shown", file=sys.stderr)
    pr = predicted(best)
    print(
        f"\nbest: {' '.join(knobs)}\npredicted: {pr['tokens_per_s']} tokens/s, trainer idle {pr['trainer_idle']}, "
        f"rollouter idle {pr['rollouter_idle']}, staleness {pr['staleness_versions_mean']} mean / "
        f"{pr['staleness_versions_max']} max versions (cap {best.max_staleness})"
    )
    return 0
