"""`slipstream plan capacity CONFIG [key=value ...] --profile P --gpus N [--png out.png] [--json]`.

Which split of N GPUs between inference servers and trainer ranks, which ``async.staleness_threshold``,
``async.sync_every`` and ``rollout.max_concurrent_per_server`` make ``fully_async`` fastest while the
staleness of what the trainer takes stays within ``async.max_staleness`` (no group dropped)? Each candidate
is one :func:`~slipstream.sim.simulate.simulate` run of the config with those overrides (seconds each).

The search, in two passes (so a plan takes tens of simulations, not the full product):

1. every split (rollout GPUs in multiples of ``cluster.gpus_per_server``: the config's own and about eight
   spread between one server and one trainer rank) times every threshold in ``--thresholds``, with the
   config's ``sync_every`` and concurrency;
2. the ``--refine`` best of pass 1 times every ``sync_every`` in ``--sync-every`` and every concurrency in
   ``--concurrency`` (factors of the config's).

Ranked by the steady step time (the mean of the second half of the simulated steps), fastest first; a
candidate over the cap is listed but never ranked first. The sync mode on the best split is simulated too
as the reference. ``--png`` draws the frontier: samples/s against mean staleness, one line per split.

Worked example::

    slipstream plan configs/recipes/qwen2.5-7b-dapo-math-64x64.yaml --profile verl.yaml --gpus 128 --png f.png
    # ... ranked table ...
    # best: rollout.num_servers=20 trainer.num_ranks=48 async.staleness_threshold=0.5 ...
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from slipstream.cli_args import (
    JSON_OBJECT,
    add_config_positionals,
    add_json_flag,
    command_parser,
    doc_paragraph,
)
from slipstream.config import Config, ConfigError
from slipstream.sim.profile import Profile, ProfileError, load_profile
from slipstream.sim.simulate import SimResult, sim_config, simulate


@dataclass
class Candidate:
    rollout_gpus: int
    trainer_gpus: int
    servers: int
    ranks: int
    threshold: float
    sync_every: int
    concurrency: int
    result: SimResult | None = None
    mode: str = "fully_async"
    max_staleness: int = 0  # the config's async.max_staleness (versions)

    @property
    def within_cap(self) -> bool:
        """No group dropped as too stale and none trained beyond the cap (``stale_policy: keep``)."""
        r = self.result
        return r is not None and r.dropped_groups == 0 and r.staleness_versions_max <= self.max_staleness

    def overrides(self) -> list[str]:
        out = [
            f"rollout.num_servers={self.servers}",
            f"trainer.num_ranks={self.ranks}",
            f"async.mode={self.mode}",
            f"rollout.max_concurrent_per_server={self.concurrency}",
        ]
        if self.mode == "fully_async":
            out += [f"async.staleness_threshold={self.threshold:g}", f"async.sync_every={self.sync_every}"]
        return out

    def row(self) -> dict[str, Any]:
        r = self.result
        assert r is not None
        return {
            "mode": self.mode,
            "rollout_gpus": self.rollout_gpus,
            "trainer_gpus": self.trainer_gpus,
            "servers": self.servers,
            "ranks": self.ranks,
            "staleness_threshold": self.threshold,
            "sync_every": self.sync_every,
            "concurrency": self.concurrency,
            "step_s": round(r.step_s_steady, 3),
            "samples_per_s": round(r.samples_per_step / r.step_s_steady, 4),  # steady, as ranked
            "trainer_idle": round(r.trainer_idle_ratio, 3),
            "rollouter_idle": round(r.rollouter_idle_ratio, 3),
            "staleness_versions_mean": round(r.staleness_versions_mean, 3),
            "staleness_versions_max": r.staleness_versions_max,
            "dropped_groups": r.dropped_groups,
            "filtered_groups": r.filtered_groups,
            "within_cap": self.within_cap,
        }


def splits(gpus: int, per_server: int, per_rank: int, current: int, count: int = 8) -> list[int]:
    """Rollout-GPU counts to try: multiples of ``per_server`` leaving at least one trainer rank."""
    top = (gpus - per_rank) // per_server
    if top < 1:
        raise ConfigError(
            f"--gpus: {gpus} GPUs cannot hold one server ({per_server} GPUs, cluster.gpus_per_server) and one "
            f"trainer rank ({per_rank} GPUs, cluster.gpus_per_trainer_rank)"
        )
    picks = {max(1, min(top, round(top * (i + 1) / (count + 1)))) for i in range(count)}
    if 1 <= current // per_server <= top:
        picks.add(current // per_server)
    return sorted(p * per_server for p in picks)


def _run(base: str, overrides: list[str], cand: Candidate, profile: Profile, steps: int) -> Candidate:
    cfg = sim_config(base, [*overrides, *cand.overrides()])
    cand.result = simulate(cfg, profile, steps=steps)
    return cand


def _key(c: Candidate) -> tuple[bool, float]:
    assert c.result is not None
    return (not c.within_cap, c.result.step_s_steady)


def search(
    base: str,
    overrides: list[str],
    profile: Profile,
    gpus: int,
    *,
    thresholds: list[float],
    sync_every: list[int],
    concurrency: list[float],
    steps: int = 16,
    refine: int = 3,
) -> tuple[list[Candidate], Candidate]:
    """Every candidate simulated (ranked, best first) and the sync reference (module docstring)."""
    cfg: Config = sim_config(base, overrides)
    per_server = cfg.cluster.gpus_per_server or 1
    per_rank = cfg.cluster.gpus_per_trainer_rank or 1
    current = cfg.rollout.num_servers * per_server
    conc0, every0 = cfg.rollout.max_concurrent_per_server, cfg.async_.sync_every

    def make(rollout: int, s: float, every: int, conc: int) -> Candidate:
        trainer = gpus - rollout
        return Candidate(
            rollout, trainer, rollout // per_server, trainer // per_rank, s, every, conc,
            max_staleness=cfg.async_.max_staleness,
        )  # fmt: skip

    seen: dict[tuple, Candidate] = {}
    for rollout in splits(gpus, per_server, per_rank, current):
        for s in thresholds:
            c = make(rollout, s, every0, conc0)
            seen[(rollout, s, every0, conc0)] = _run(base, overrides, c, profile, steps)
    first = sorted(seen.values(), key=_key)[:refine]
    for c in first:
        for every in sync_every:
            for factor in concurrency:
                conc = max(1, round(conc0 * factor))
                k = (c.rollout_gpus, c.threshold, every, conc)
                if k not in seen:
                    seen[k] = _run(
                        base, overrides, make(c.rollout_gpus, c.threshold, every, conc), profile, steps
                    )
    ranked = sorted(seen.values(), key=_key)
    best = ranked[0]
    ref = make(best.rollout_gpus, 0.0, 1, best.concurrency)
    ref.mode = "sync"
    _run(base, overrides, ref, profile, steps)
    return ranked, ref


def draw_frontier(ranked: list[Candidate], path: str) -> None:
    """Samples/s against mean staleness, one line per split (over thresholds, at the config's knobs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_split: dict[int, list[Candidate]] = {}
    for c in ranked:
        by_split.setdefault(c.rollout_gpus, []).append(c)
    for rollout, cands in sorted(by_split.items()):
        pts = sorted(
            (
                c.result.staleness_versions_mean,
                c.result.samples_per_step / c.result.step_s_steady,
                c.within_cap,
            )
            for c in cands
            if c.result
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{rollout} rollout / "
                f"{cands[0].trainer_gpus} trainer GPUs")  # fmt: skip
        over = [p for p in pts if not p[2]]
        ax.scatter([p[0] for p in over], [p[1] for p in over], marker="x", color="red", zorder=3)
    ax.set_xlabel("mean staleness of trained groups (weight versions)")
    ax.set_ylabel("samples / s (simulated, steady)")
    ax.set_title("throughput vs staleness per pool split (red x: over max_staleness)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["rollout_gpus", "trainer_gpus", "staleness_threshold", "sync_every", "concurrency", "step_s",
            "samples_per_s", "trainer_idle", "rollouter_idle", "staleness_versions_mean", "staleness_versions_max",
            "dropped_groups"]  # fmt: skip
    heads = ["#", "roll", "train", "s", "every", "conc", "step_s", "samp/s", "t_idle", "r_idle", "stale",
             "vmax", "drop"]  # fmt: skip
    lines = [" ".join(h.rjust(7) for h in heads)]
    for i, row in enumerate(rows, 1):
        lines.append(" ".join([str(i).rjust(7), *(str(row[c]).rjust(7) for c in cols)]))
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str]) -> int:
    p = command_parser("slipstream plan capacity", doc_paragraph(__doc__, 1))
    add_config_positionals(p)
    # Hand-written: the config comes as CONFIG key=value; these are the search (lists of candidates), no key.
    p.add_argument("--profile", required=True)
    p.add_argument("--gpus", type=int, required=True, help="GPUs for servers and trainer ranks together")
    p.add_argument("--png", help="draw the frontier here")
    p.add_argument("--steps", type=int, default=16, help="simulated trainer steps per candidate")
    p.add_argument("--thresholds", default="0,0.25,0.5,1,2")
    p.add_argument("--sync-every", default="1,2,4")
    p.add_argument("--concurrency", default="0.5,1,2", help="factors of rollout.max_concurrent_per_server")
    p.add_argument("--refine", type=int, default=3, help="best candidates of pass 1 refined in pass 2")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    add_json_flag(p, JSON_OBJECT)
    args = p.parse_args(argv)
    try:
        profile = load_profile(args.profile)
        ranked, ref = search(
            args.config, args.overrides, profile, args.gpus,
            thresholds=_floats(args.thresholds), sync_every=[int(x) for x in _floats(args.sync_every)],
            concurrency=_floats(args.concurrency), steps=args.steps, refine=args.refine,
        )  # fmt: skip
    except (ConfigError, ProfileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    best = ranked[0]
    if args.png:
        draw_frontier(ranked, args.png)
    if args.json:
        print(json.dumps({"best": best.row(), "overrides": best.overrides(), "sync": ref.row(),
                          "ranked": [c.row() for c in ranked]}))  # fmt: skip
        return 0
    print(_table([c.row() for c in ranked[: args.top]]))
    r, s = best.result, ref.result
    assert r is not None and s is not None
    print(f"\nsync on the same split: {s.step_s_steady:.2f} s/step; best fully_async {r.step_s_steady:.2f} s/step "
          f"({s.step_s_steady / r.step_s_steady:.2f}x)")  # fmt: skip
    if not best.within_cap:
        print("no candidate kept staleness within async.max_staleness; the fastest is shown", file=sys.stderr)
    print("best: " + " ".join(best.overrides()))
    if args.png:
        print(f"frontier: {args.png}")
    return 0
