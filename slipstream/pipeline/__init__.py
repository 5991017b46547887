"""`slipstream train CONFIG [key=value ...]`: the single controller and the three training modes.

The package is the only place (with ``cli.py``) that imports every role (design.md §2):

* ``modes.py``: ``sync`` / ``one_step_off`` / ``fully_async`` as presets of the ``async`` section, and the
  config checks that run before anything starts;
* ``controller.py``: :class:`Pipeline`, which starts the queue, the inference servers, the rollouter and
  the trainer ranks on Ray resource pools, drives steps and weight pushes, checkpoints, watches health and
  shuts everything down;
* ``actors.py``: the Ray actors that host the parts;
* ``checkpoint.py``: run checkpoints consistent across parts, and the record of trained samples.

Exit codes of ``main``: 0 done, 1 a part failed (the message names it), 2 a bad config or command line
(nothing was started), 130 interrupted (every part was stopped).
"""

from __future__ import annotations

import argparse
import sys

from slipstream.pipeline.controller import PartFailed, Pipeline, RunResult

__all__ = ["PartFailed", "Pipeline", "RunResult", "main"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slipstream train",
        description="Train a model: start every part, run the configured steps, stop everything.",
        epilog="Example: slipstream train configs/quickstart.yaml trainer.lr=2e-5 async.mode=sync",
    )
    parser.add_argument("config", help="a YAML preset (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.lr=2e-5")
    args = parser.parse_args(argv)
    from slipstream.config import ConfigError, load_config

    try:
        pipeline = Pipeline(load_config(args.config, args.overrides))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    pipeline.stop_on_sigterm = True
    try:
        result = pipeline.run()
    except KeyboardInterrupt:
        print("slipstream train: interrupted; every part was stopped", file=sys.stderr)
        return 130
    except (PartFailed, ConfigError) as err:
        print(f"slipstream train: {err}", file=sys.stderr)
        return 1
    print(
        f"slipstream train: {result.version} steps in {result.wall_s:.0f} s; metrics in "
        f"{result.run_dir}/metrics.jsonl (curves: slipstream plot {result.run_dir})",
        file=sys.stderr,
    )
    return 0
