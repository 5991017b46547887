"""Performance profiles: the measured (or published) rates the simulator turns into step times.

A profile is a small YAML file, written by ``slipstream profile RUN_DIR`` from a run's ``metrics.jsonl``
or by hand from published figures. Every field, with its unit::

    source: "where the figures come from (free text)"
    decode:                       # one inference server (all its GPUs), decode only
      concurrency: [1, 64]        # requests decoding at once on the server
      tokens_per_s: [40, 2560]    # the server's total decode tokens/s at that concurrency; interpolated
                                  # linearly, 0 at 0, flat past the last point (each request then slows)
    prefill_tokens_per_s: 20000   # prompt tokens/s of one request's prefill (also the prefix recomputed
                                  # when a request aborted by a weight push resumes)
    prompt_tokens: 120            # mean prompt length
    lengths:                      # response lengths, drawn per sample, clipped to [1, max_new_tokens]
      mean: 900                   # mean before clipping (tokens)
      sigma: 1.0                  # log-normal shape: sd of log(length); larger = longer tail
      samples: []                 # optional: measured lengths, drawn from instead of the log-normal
      drift_per_step: 0.0         # mean grows by this fraction of the first step's mean per trainer step
    trainer:
      tokens_per_s_per_rank: 2000 # prompt + response tokens one trainer rank trains per second
      fixed_s: 0.5                # per-step cost that does not scale with tokens (optimizer step, ...)
    push:
      fixed_s: 0.2                # per weight push: pause, handshakes, resume
      s_per_byte: 1.0e-9          # per pushed byte
      model_bytes: 270000000      # bytes one push sends
    step_overhead_s: 0.1          # the controller's own per-step time (metrics, bookkeeping)
    filtered_fraction: 0.0        # share of groups dynamic sampling drops (all samples scored the same)
    model:                        # optional: the model the rates are of (scale_to_model scales from it)
      params: 7.6e9               # total parameters (held and pushed)
      active_params: 0            # parameters a token runs through: an MoE's routed share; 0 = all (dense)

:func:`load_profile` validates a file and names the offending field (``profile field decode.tokens_per_s:
...``); :func:`profile_from_run` fits one to a run directory; :func:`save_profile` writes one back.

Worked example::

    prof = profile_from_run("runs/quickstart")
    save_profile(prof, "quickstart.profile.yaml")
    load_profile("quickstart.profile.yaml") == prof      # True
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from slipstream.cli_args import command_parser

# The data (structs, load and save) lives in sim/types.py, which the simulator imports; here is the fitting.
from slipstream.sim.types import (  # noqa: F401  (this module's public names since before the split)
    DecodeCurve,
    Lengths,
    Profile,
    ProfileError,
    PushCost,
    TrainerRates,
    check_profile,
    load_profile,
    parse_profile,
    save_profile,
)


# ---------------------------------------------------------------------------------------------- from a run
def _records(run_dir: Path) -> list[dict[str, Any]]:
    from slipstream.metrics import read_metrics

    records = read_metrics(run_dir)
    if not records:
        raise ProfileError(f"{run_dir}/metrics.jsonl has no step records")
    return records


def _run_config(run_dir: Path) -> Any:
    from slipstream.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ProfileError(f"{path} is missing: profiles are made from run directories the pipeline wrote")
    return load_config(path)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0``; through the origin when x does not vary."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 1e-9 * max(1.0, mx * mx) or len(xs) < 3:
        return 0.0, my / mx if mx > 0 else 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    if a < 0 or b <= 0:
        return 0.0, my / mx if mx > 0 else 0.0
    return a, b


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _clipped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(L, cap)] for log(L) ~ N(mu, sigma)."""
    c = math.log(cap)
    return math.exp(mu + sigma * sigma / 2) * _phi((c - mu - sigma * sigma) / sigma) + cap * (
        1 - _phi((c - mu) / sigma)
    )


def fit_lengths(
    mean: float, cap: float, share_at_cap: float, default_sigma: float = 1.0
) -> tuple[float, float]:
    """(pre-clip mean, sigma) of a log-normal whose lengths clipped at ``cap`` average ``mean`` with
    ``share_at_cap`` of them at the cap: a grid over sigma, mu solved for the clipped mean at each. With no
    sample at the cap there is no tail to fit: ``default_sigma``."""
    mean = min(mean, cap * (1 - 1e-6))

    def mu_for(sigma: float) -> float:
        lo, hi = math.log(mean) - 10 * sigma - 10, math.log(cap) + 10 * sigma
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _clipped_mean(mid, sigma, cap) < mean else (lo, mid)
        return (lo + hi) / 2

    if share_at_cap <= 0:
        mu = mu_for(default_sigma)
        return math.exp(mu + default_sigma**2 / 2), default_sigma
    best = None
    for i in range(1, 301):
        sigma = i / 100
        mu = mu_for(sigma)
        err = abs((1 - _phi((math.log(cap) - mu) / sigma)) - share_at_cap)
        if best is None or err < best[0]:
            best = (err, mu, sigma)
    assert best is not None
    _, mu, sigma = best
    return math.exp(mu + sigma * sigma / 2), sigma


def profile_from_run(run_dir: str | Path, *, skip_first: int = 1) -> Profile:
    """Fit a profile to a run (docs/tuning.md, "Planning before a run").

    From the metrics: prompt length (trained tokens per sample less the response mean), the clipped
    log-normal of response lengths (:func:`fit_lengths`) and its drift, the trainer's rate (compute = step
    less lease wait, against tokens), push seconds per byte, the controller's own time per step. The decode
    rate is then fitted with the simulator (:func:`fit_decode`) to the time the trainer waited for batches;
    a run whose trainer never waited gives only a lower bound, so profile a ``sync`` run (or one whose
    trainer waited). The first ``skip_first`` steps are left out of the fits (start-up and warm-up) when the
    run has more steps than that."""
    run = Path(run_dir)
    cfg = _run_config(run)
    all_records = _records(run)
    recs = all_records[skip_first:] if len(all_records) > skip_first else all_records
    num_servers = len(cfg.rollout.server_urls) or cfg.rollout.num_servers
    samples = [r.get("trainer/samples", 0.0) for r in recs]
    resp = [r.get("trainer/response_len_mean", 0.0) for r in recs]
    prompt = statistics.fmean(
        max(0.0, r["trainer/tokens"] / r["trainer/samples"] - r["trainer/response_len_mean"])
        for r in recs
        if r.get("trainer/samples")
    )
    # trainer compute: the step's own time less the time it waited for its batch
    compute = [
        max(1e-6, r["trainer/step_s"] - r.get("trainer/idle_ratio", 0.0) * r["perf/step_wall_s"])
        for r in recs
    ]
    tokens = [r["trainer/tokens"] for r in recs]
    fixed, s_per_token = _fit_line(tokens, compute)
    ranks = cfg.trainer.num_ranks
    # decode: fitted below, with the simulator, to the time the trainer waited for its batches
    busy = [
        (r.get("rollouter/generated_tokens_per_s", 0.0), 1 - r.get("rollouter/idle_ratio", 0.0)) for r in recs
    ]
    rates = [tps / b / num_servers for tps, b in busy if tps > 0 and b > 0.05]
    if not rates:
        raise ProfileError(
            f"{run}: no step generated tokens (rollouter/generated_tokens_per_s is 0 throughout)"
        )
    n_req = cfg.trainer.batch_groups * cfg.rollout.n
    conc = max(1.0, min(float(cfg.rollout.max_concurrent_per_server), n_req / num_servers))
    # pushes and overheads
    pushes = [r for r in recs if r.get("sync/bytes")]
    model_bytes = statistics.fmean(r["sync/bytes"] for r in pushes) if pushes else 0.0
    push_s = statistics.fmean(r["sync/publish_s"] for r in pushes) if pushes else 0.0
    # the controller's own time: a step's cycle (between two records) less the step, and the push and drain
    # the previous record made
    overhead = [
        max(0.0, b["perf/elapsed_s"] - a["perf/elapsed_s"] - b["trainer/step_s"] - a.get("sync/publish_s", 0.0)
            - a.get("sync/drain_s", 0.0))
        for a, b in zip(all_records[skip_first - 1 if skip_first else 0:], all_records[max(skip_first, 1):],
                        strict=False)
    ] or [0.0]  # fmt: skip
    cap = cfg.rollout.sampling.max_new_tokens
    mean_len = statistics.fmean(v for v in resp if v > 0) if any(resp) else 1.0
    at_cap = statistics.fmean(r.get("rollouter/finish_length", 0.0) for r in recs)
    fitted_mean, sigma = fit_lengths(mean_len, cap, at_cap)
    drift = _drift(
        [r["step"] for r in all_records], [r.get("trainer/response_len_mean", 0.0) for r in all_records]
    )
    prof = check_profile(
        Profile(
            source=f"slipstream profile {run} ({len(all_records)} steps, mode {cfg.async_.mode}, "
            f"{sum(samples):.0f} samples)",
            decode=DecodeCurve(concurrency=[conc], tokens_per_s=[statistics.median(rates)]),
            # Metrics do not separate prefill from decode: prefill is taken as ten times the decode rate.
            prefill_tokens_per_s=10.0 * statistics.median(rates),
            prompt_tokens=round(prompt, 2),
            lengths=Lengths(
                mean=round(fitted_mean, 2), sigma=round(sigma, 3), drift_per_step=round(drift, 5)
            ),
            trainer=TrainerRates(tokens_per_s_per_rank=1.0 / s_per_token / ranks, fixed_s=round(fixed, 4)),
            push=PushCost(
                fixed_s=0.0, s_per_byte=push_s / model_bytes if model_bytes else 0.0, model_bytes=model_bytes
            ),  # fmt: skip
            step_overhead_s=round(statistics.median(overhead), 4),
            filtered_fraction=round(_filter_ratio(recs), 4),
        )
    )
    waits = [r.get("trainer/idle_ratio", 0.0) * r["perf/step_wall_s"] for r in recs]
    return fit_decode(cfg, prof, statistics.fmean(waits), steps=len(all_records), skip_first=skip_first)


def _filter_ratio(recs: list[dict]) -> float:
    """Share of a run's finished groups dynamic sampling dropped (0 for a run without the filter)."""
    ratios = [r["rollouter/filter_ratio"] for r in recs if r.get("rollouter/filter_ratio") is not None]
    return min(0.99, statistics.fmean(ratios)) if ratios else 0.0


def fit_decode(cfg: Any, prof: Profile, wait_s: float, *, steps: int, skip_first: int = 1) -> Profile:
    """Scale the decode curve (one request's speed held up to the run's concurrency) until the simulated run
    waits ``wait_s`` per step for its batches, as the measured one did (bisection on a log scale).

    Why not generated tokens / busy time: a batch's tail decodes with few requests in flight, so that
    average mixes concurrencies; the simulator replays the same mix."""
    from slipstream.pipeline.modes import prepare_config
    from slipstream.sim.simulate import simulate

    cfg = prepare_config(cfg)[0]
    conc = prof.decode.concurrency[-1]

    def with_speed(v: float) -> Profile:
        curve = DecodeCurve(
            concurrency=[1.0, conc] if conc > 1 else [1.0], tokens_per_s=[v, v * conc][: 2 if conc > 1 else 1]
        )
        return msgspec.structs.replace(prof, decode=curve, prefill_tokens_per_s=10.0 * v * conc)

    def sim_wait(v: float) -> float:
        res = simulate(cfg, with_speed(v), steps=steps)
        waits = [i * (s - 0.0) for i, s in zip(res.trainer_idle, res.step_s, strict=True)][skip_first:]
        return statistics.fmean(waits or [0.0])

    lo, hi = math.log(1e-3), math.log(1e6)
    for _ in range(30):  # waiting shrinks as decoding speeds up
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sim_wait(math.exp(mid)) > wait_s else (lo, mid)
    return with_speed(round(math.exp((lo + hi) / 2), 4))


def _drift(steps: list[float], means: list[float]) -> float:
    """Relative growth of the mean response length per step (a least-squares slope over the first mean);
    0 for fewer than 8 steps (too few to tell drift from noise)."""
    pairs = [(s, m) for s, m in zip(steps, means, strict=True) if m > 0]
    if len(pairs) < 8:
        return 0.0
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    first = my - slope * (mx - xs[0])
    return slope / first if first > 0 else 0.0


def main(argv: list[str]) -> int:
    """`slipstream profile RUN_DIR [-o profile.yaml]`."""
    p = command_parser("slipstream profile", "Fit a performance profile to a run.")
    # Hand-written: a run directory and the fit's settings, no config key.
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", help="write the profile here (default: print it)")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the rate fits")
    args = p.parse_args(argv)
    try:
        prof = profile_from_run(args.run_dir, skip_first=args.skip_first)
    except (ProfileError, FileNotFoundError) as err:
        print(f"profile error: {err}", file=sys.stderr)
        return 2
    if args.output:
        save_profile(prof, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(yaml.safe_dump(msgspec.to_builtins(prof), sort_keys=False), end="")
    return 0
