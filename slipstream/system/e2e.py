"""``slipstream bench e2e``: trained samples per second of ``fully_async`` against ``sync``, end to end.

Both modes run the same workload, one after the other in one invocation on this machine, through the whole
pipeline (Ray actors, one inference server: the embedded one, or vLLM's CPU build with ``--backend vllm``;
queue, FSDP trainer, weight pushes every step): the quickstart
(SmolLM2-135M-Instruct learning "What is a + b? Reply with only the number." from its own rewards) with a
long tail of response lengths. The tail is the model's own: sampled at temperature 1.0 with the budget
raised from 32 to ``--max-new-tokens`` (384) tokens, most answers are a few to a few dozen tokens while a
few ramble on to the cap (measured on the untrained model: median 30, p90 104, about 5% at a 256 cap), so
the cap is ~13x the median, the shape of long chain-of-thought RL (DAPO's 20K-token cap over responses of
1-2K). Nothing pads or forces lengths: a sync step waits for its slowest sample, which is what makes the
tail expensive.

Each mode trains the same number of steps of the same batch (``--steps`` x ``--batch-groups`` x ``--n``
samples: equal sample count) from the same initial weights and prompts. Throughput is trained samples over
the wall time from "all parts up" to the last step (start-up excluded, the first batch's generation
included); reward is the mean training reward over all those samples.

Processes and threads are the mode's own best layout on a 2-core machine: ``sync`` alternates generation
and training, so each gets both cores (``--sync-threads``, default 2 each); ``fully_async`` overlaps them,
one core for each (``--async-server-threads`` 1, ``--async-trainer-threads`` 1; a second trainer thread
on the server's core was no faster, 42 s against 40 s per step at a 192 cap, as it helps only while the
server waits on the staleness gate).

``fully_async`` runs with ``--staleness-threshold`` 2 and ``--max-staleness`` 4 (the quickstart has 1 and 2): at
threshold 1 both its idle ratios stayed high (0.16 trainer, 0.26 server), the sign docs/tuning.md gives for
raising it. Samples per second is the figure asked for; ``tokens_s`` (prompt + response tokens trained per
second) is reported beside it because fully asynchronous training streams the groups that finish first, so
over a short run it trains more of the short samples, and samples/s alone flatters it.

The last line of ``--json`` is one JSON object: ``{"sync_samples_s", "fully_async_samples_s",
"sync_reward", "fully_async_reward", "sync_tokens_s", "fully_async_tokens_s", "speedup", "token_speedup",
"samples", ...}``; each mode's summary also says where its steps' time went (the mean ``time/*`` of the
run's records: trainer waiting and computing, the push, the servers paused by it, the rest). ``--summarize
OUT`` reports the runs an earlier invocation left in ``OUT`` again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
TIME_SPLIT = (
    "time/step_s",
    "time/trainer_wait_s",
    "time/trainer_compute_s",
    "time/push_s",
    "time/servers_paused_s",
    "time/other_s",
)


def _parser() -> argparse.ArgumentParser:
    """``--batch-groups``, ``--n``, ``--max-new-tokens``, ``--staleness-threshold`` and ``--max-staleness``
    are keys of the run config, generated from it under the bench's defaults; the rest are the bench's own."""
    from slipstream.config import Config

    p = command_parser("slipstream bench e2e", doc_paragraph(__doc__))
    p.add_argument("--config", default=str(QUICKSTART), help="base preset (default: configs/quickstart.yaml)")
    p.add_argument("--steps", type=int, default=8, help="trainer steps per mode")
    add_key_option(p, Config, "trainer.batch_groups", default=4)
    add_key_option(p, Config, "rollout.n", default=8)
    add_key_option(p, Config, "rollout.sampling.max_new_tokens", default=384, note="The long tail's end.")
    p.add_argument("--sync-threads", type=int, default=2, help="server and trainer threads in sync mode")
    p.add_argument("--async-server-threads", type=int, default=1)
    p.add_argument("--async-trainer-threads", type=int, default=1)
    add_key_option(p, Config, "async.staleness_threshold", default=2.0, note="Set in fully_async runs only.")
    add_key_option(p, Config, "async.max_staleness", default=4, note="Set in fully_async runs only.")
    add_key_option(
        p, Config, "rollout.backend", default="embedded", note="The recorded runs are the embedded server's."
    )
    p.add_argument("--modes", default="sync,fully_async", help="comma-separated, run in this order")
    p.add_argument("--out", help="run directories go here (default: a temporary directory)")
    add_json_flag(p)
    p.add_argument(
        "--summarize", metavar="OUT", help="only report the runs an earlier invocation left in OUT"
    )
    return p


def _overrides(args: argparse.Namespace, mode: str, out: Path, data: Path) -> list[str]:
    from slipstream.serverkinds import server_kind

    sync = mode == "sync"
    server = args.sync_threads if sync else args.async_server_threads
    trainer = args.sync_threads if sync else args.async_trainer_threads
    overrides = [
        f"async.mode={mode}",
        f"run.name=e2e-{mode}",
        f"run.output_dir={out}",
        f"run.total_steps={args.steps}",
        "run.resume=false",
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.n={args.n}",
        f"trainer.batch_groups={args.batch_groups}",
        "trainer.checkpoint_every=0",
        f"rollout.backend={args.backend}",
        f"{server_kind(args.backend).cpu_threads_key}={server}",
        f"cluster.trainer_threads={trainer}",
        "wandb.mode=disabled",
    ]
    if not sync and args.staleness_threshold is not None:
        overrides.append(f"async.staleness_threshold={args.staleness_threshold}")
    if not sync and args.max_staleness is not None:
        overrides.append(f"async.max_staleness={args.max_staleness}")
    return overrides


def _summary(run_dir: Path, cap: int) -> dict[str, float]:
    from slipstream.metrics import read_metrics

    records = read_metrics(run_dir)
    wall = sum(r["perf/step_wall_s"] for r in records)
    samples = sum(r["trainer/samples"] for r in records)
    rewards = [r["trainer/reward_mean"] * r["trainer/samples"] for r in records]
    return {
        "samples": samples,
        "wall_s": round(wall, 2),
        "samples_s": round(samples / wall, 4),
        # prompt + response tokens trained per second: unlike samples/s, not flattered by short samples
        "tokens_s": round(sum(r["trainer/tokens"] for r in records) / wall, 2),
        "reward": round(sum(rewards) / samples, 4),
        "response_len_mean": round(statistics.fmean(r["trainer/response_len_mean"] for r in records), 2),
        "at_cap": round(statistics.fmean(r.get("rollouter/finish_length", 0.0) for r in records), 4),
        "trainer_idle": round(statistics.fmean(r["trainer/idle_ratio"] for r in records), 3),
        "rollouter_idle": round(statistics.fmean(r["rollouter/idle_ratio"] for r in records), 3),
        "staleness_versions_mean": round(
            statistics.fmean(r["trainer/staleness_versions_mean"] for r in records), 3
        ),
        "cap": cap,
        # where a step's time went (driver.step_time_split), mean seconds per step
        **{k: round(statistics.fmean(r.get(k, 0.0) for r in records), 3) for k in TIME_SPLIT},
    }


def run_mode(args: argparse.Namespace, mode: str, out: Path, data: Path) -> dict[str, float]:
    from slipstream.config import load_config
    from slipstream.pipeline import Pipeline

    cfg = load_config(args.config, _overrides(args, mode, out, data))
    t0 = time.monotonic()
    result = Pipeline(cfg).run()
    summary = _summary(result.run_dir, args.max_new_tokens)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    print(f"{mode}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    return summary


def _prompts(path: Path, n: int) -> Path:
    from slipstream.agents.datagen import make_rows, write_rows

    write_rows(make_rows("arithmetic", n, seed=1), path)
    return path


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    import ray

    results: dict[str, dict[str, Any]]
    if args.summarize:  # the result of an earlier invocation, from its run directories
        results = {m: _summary(Path(args.summarize) / f"e2e-{m}", args.max_new_tokens) for m in modes}
    else:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="slipstream-e2e-"))
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
    row: dict[str, Any] = {}
    for key in ("samples_s", "reward", "tokens_s"):
        for mode, summary in results.items():
            row[f"{mode}_{key}"] = summary[key]
    if "sync" in results and "fully_async" in results:
        row["speedup"] = round(results["fully_async"]["samples_s"] / results["sync"]["samples_s"], 3)
        row["token_speedup"] = round(results["fully_async"]["tokens_s"] / results["sync"]["tokens_s"], 3)
    row["samples"] = next(iter(results.values()))["samples"]
    row["max_new_tokens"] = args.max_new_tokens
    row["modes"] = results
    if args.json:
        print(json.dumps(row))
    else:
        for key, value in row.items():
            if key != "modes":
                print(f"{key:>24}: {value}")
    return 0
