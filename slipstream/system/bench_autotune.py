"""``slipstream bench autotune``: the autotune controller on the real pipeline, against the same run without it.

Two runs of the whole pipeline (Ray actors, one embedded inference server, queue, FSDP trainer, a push
every step), one after the other in one invocation so that both see the same machine, from the same poor
setting: ``async.staleness_threshold`` 0, so the gate admits one batch per weight version and generation
waits for every push, as in ``sync`` (docs/tuning.md, "The admission budget"). One run keeps it
(``async.autotune: off``); the other lets the controller move it (``async.autotune: throughput``, a decision
every ``--autotune-every`` steps, inside the default ``async.autotune_bounds``: staleness cap 2, threshold at
most 2). The workload is the one ``slipstream bench simulate`` records: SmolLM2-135M on the arithmetic
prompts, 2 prompts x 4 samples per step, a 96-token cap with the model's own long tail at temperature 1.0,
one core for the server and one for the trainer; generation is the bottleneck at threshold 0 (the trainer
waits about 60% of each step).

Both runs train the same number of steps from the same weights and prompts. Throughput is prompt +
response tokens trained over the sum of the steps' wall times (start-up excluded), as in ``slipstream bench
e2e``; ``ratio`` is the autotuned run's over the fixed run's. The controller's decisions are its
``autotune/*`` metrics (the threshold each step) and the reasons the step driver logged. The load average
before and after each run is reported too: on a shared machine, compare runs only under the same load.

The last line of ``--json`` is one JSON object: ``{"off_tokens_s", "on_tokens_s", "ratio", "modes": {mode:
summary}}``, each summary ``bench e2e``'s plus ``thresholds`` (the controller's threshold at each step),
``decisions`` (step and reason of each change) and ``load`` (1-minute load average before, after).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.system.e2e import QUICKSTART, _prompts, _summary

MODES = ("off", "on")


def _parser() -> argparse.ArgumentParser:
    from slipstream.config import Config

    p = command_parser("slipstream bench autotune", doc_paragraph(__doc__))
    p.add_argument("--config", default=str(QUICKSTART), help="base preset (default: configs/quickstart.yaml)")
    p.add_argument("--steps", type=int, default=16, help="trainer steps per run")
    add_key_option(p, Config, "trainer.batch_groups", default=2)
    add_key_option(p, Config, "rollout.n", default=4)
    add_key_option(p, Config, "rollout.sampling.max_new_tokens", default=96)
    add_key_option(p, Config, "async.staleness_threshold", default=0.0, note="The poor start of both runs.")
    add_key_option(p, Config, "async.autotune_every", default=2)
    p.add_argument("--modes", default="off,on", help="autotune off / on, comma-separated, run in this order")
    p.add_argument("--out", help="run directories go here (default: a temporary directory)")
    add_json_flag(p)
    return p


def _overrides(args: argparse.Namespace, mode: str, out: Path, data: Path) -> list[str]:
    return [
        "async.mode=fully_async",
        f"async.staleness_threshold={args.staleness_threshold}",
        "async.max_staleness=2",  # the controller's cap: prepare_config lowers it there anyway
        f"async.autotune={'throughput' if mode == 'on' else 'off'}",
        f"async.autotune_every={args.autotune_every}",
        f"run.name=autotune-{mode}",
        f"run.output_dir={out}",
        f"run.total_steps={args.steps}",
        "run.resume=false",
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.n={args.n}",
        f"trainer.batch_groups={args.batch_groups}",
        "trainer.checkpoint_every=0",
        "rollout.backend=embedded",
        "rollout.embedded.num_threads=1",
        "cluster.trainer_threads=1",
        "eval.every=0",
        "wandb.mode=disabled",
    ]


class _Decisions(logging.Handler):
    """The step driver's ``autotune at step N: reason`` lines (it runs in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("autotune at step"):
            self.lines.append(msg.removeprefix("autotune at step "))


def run_mode(args: argparse.Namespace, mode: str, out: Path, data: Path) -> dict[str, Any]:
    from slipstream.config import load_config
    from slipstream.metrics import read_metrics
    from slipstream.pipeline import Pipeline

    cfg = load_config(args.config, _overrides(args, mode, out, data))
    handler, logger = _Decisions(), logging.getLogger("slipstream.pipeline.driver")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        result = Pipeline(cfg).run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    summary: dict[str, Any] = _summary(result.run_dir, args.max_new_tokens)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    summary["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    records = read_metrics(result.run_dir)
    summary["thresholds"] = [r.get("autotune/staleness_threshold") for r in records]
    summary["staleness_versions_max"] = max(r.get("trainer/staleness_versions_max", 0.0) for r in records)
    summary["dropped_groups"] = sum(r.get("trainer/dropped_groups", 0.0) for r in records)
    summary["decisions"] = handler.lines
    print(f"autotune {mode}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    return summary


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma-separated list of {', '.join(MODES)}, got {args.modes!r}")
    import ray

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="slipstream-autotune-"))
    data = _prompts(out / "prompts.parquet", args.steps * args.batch_groups)
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        resources={"rollout_pool": 1, "trainer_pool": 1},
    )
    try:
        results = {m: run_mode(args, m, out, data) for m in modes}
    finally:
        ray.shutdown()
    row: dict[str, Any] = {f"{m}_tokens_s": s["tokens_s"] for m, s in results.items()}
    if "off" in results and "on" in results:
        row["ratio"] = round(results["on"]["tokens_s"] / results["off"]["tokens_s"], 3)
    row["steps"] = args.steps
    row["modes"] = results
    if args.json:
        print(json.dumps(row))
    else:
        for key, value in row.items():
            if key != "modes":
                print(f"{key:>14}: {value}")
        for mode, s in results.items():
            print(f"{mode}: thresholds {s['thresholds']}")
            for line in s["decisions"]:
                print(f"  {line}")
    return 0
