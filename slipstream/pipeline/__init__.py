"""`slipstream train CONFIG [key=value ...]`: the single controller and the three training modes.

The package is the only place (with ``cli.py``) that imports every role (design.md §2):

* ``modes.py``: ``sync`` / ``one_step_off`` / ``fully_async`` as presets of the ``async`` section, and the
  config checks that run before anything starts;
* ``controller.py``: :class:`Pipeline`, the composition of the four parts below that ``slipstream train``
  runs: start, train ``total_steps``, stop on request, always shut down;
* ``launcher.py``: start-up (its order is written once, in ``Launcher.start_parts``) and shutdown;
* ``parts.py``: :class:`~slipstream.pipeline.parts.Parts`, the actors' typed handles, with each kind of
  server in a ``ServerPool`` of ``ServerSlot(handle, url)`` that makes every write to them;
* ``driver.py``: the step driver (steps, weight pushes, the metrics record);
* ``supervisor.py``: health checks and the restart policy for servers and trainer ranks;
* ``checkpoint.py``: run checkpoints consistent across parts (the coordinator), and the record of trained
  samples; the directory layout is ``slipstream/utils/checkpoints.py``;
* ``handles.py``: one typed handle per role (``TrainerGroup``, ``RolloutHandle``, ``ServerHandle``,
  ``QueueHandle``), one method per operation: how those parts call the actors;
* ``cluster.py``: the small cluster interface under the handles (spawn, call, get, wait, kill), and Ray's;
* ``health.py``: what counts as a dead server and the restart flow shared by rollout and judge servers;
* ``types.py``: the msgspec Structs of every call to the actors and every report they return;
* ``actors.py``: the Ray actors that host the parts;
* ``placement.py``: the pools reserved as Ray placement groups before any model loads.

Exit codes of ``main``: 0 done, 1 a part failed (the message names it), 2 a bad config or command line
(nothing was started), 130 interrupted (every part was stopped), 143 stopped by SIGTERM after a step and a
checkpoint (a second SIGTERM stops at once, as Ctrl-C does). With ``--check-placement`` nothing is
started but the reservation: 0 when every part fits the cluster (the layout is printed), 1 naming the
shortfall.
"""

from __future__ import annotations

import sys

from slipstream.cli_args import config_overrides, config_parser
from slipstream.config import Config
from slipstream.pipeline.controller import PartFailed, Pipeline, RunResult

__all__ = ["PartFailed", "Pipeline", "RunResult", "main"]


def main(argv: list[str]) -> int:
    parser, keys = config_parser(
        "slipstream train",
        "Train a model: start every part, run the configured steps, stop everything.",
        Config,
        epilog="Example: slipstream train configs/quickstart.yaml trainer.lr=2e-5 async.mode=sync",
    )
    parser.add_argument(
        "--check-placement",
        action="store_true",
        help="connect to cluster.ray_address, reserve every part, print the layout, release; exit 0 when "
        "everything fits, 1 naming the shortfall (loads no model, reads no data)",
    )
    args = parser.parse_intermixed_args(argv)  # flags may follow the overrides
    args.overrides = [*args.overrides, *config_overrides(args, keys)]
    from slipstream.config import ConfigError, load_config

    if args.check_placement:
        return check_placement(args.config, args.overrides)

    try:
        pipeline = Pipeline(load_config(args.config, args.overrides))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    pipeline.stop_on_sigterm = True
    pipeline.reap_if_killed = True
    try:
        result = pipeline.run()
    except KeyboardInterrupt:
        print("slipstream train: interrupted; every part was stopped", file=sys.stderr)
        return 130
    except (PartFailed, ConfigError) as err:
        print(f"slipstream train: {err}", file=sys.stderr)
        return 1
    if result.stopped:
        print(
            f"slipstream train: stopped on request after step {result.version} with a checkpoint; the same "
            "command continues the run",
            file=sys.stderr,
        )
        return 143
    print(
        f"slipstream train: {result.version} steps in {result.wall_s:.0f} s; metrics in "
        f"{result.run_dir}/metrics.jsonl (curves: slipstream plot {result.run_dir})",
        file=sys.stderr,
    )
    return 0


def check_placement(config: str, overrides: list[str]) -> int:
    """`slipstream train CONFIG --check-placement`: reserve the run's pools on its cluster and print them."""
    import ray

    from slipstream.config import ConfigError, load_config
    from slipstream.pipeline.controller import connect_ray
    from slipstream.pipeline.modes import check_config, prepare_config

    try:
        cfg, _ = prepare_config(load_config(config, overrides))
        check_config(cfg, environment=False)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    started = connect_ray(cfg)
    try:
        return _reserve_and_show(cfg)
    finally:
        if started:
            ray.shutdown()


def _reserve_and_show(cfg) -> int:
    import ray

    from slipstream.config import ConfigError
    from slipstream.pipeline.controller import check_hosts, check_pools
    from slipstream.pipeline.placement import Placement, PlacementError, format_layout

    try:
        check_pools(cfg, ray.cluster_resources())
        check_hosts(cfg, sum(1 for n in ray.nodes() if n.get("Alive")))
        placement = Placement.reserve(cfg)
    except (ConfigError, PlacementError) as err:
        print(f"slipstream train --check-placement: {err}", file=sys.stderr)
        return 1
    try:
        print(format_layout(placement.layout()))
    finally:
        placement.release()
    print("placement: every part fits", file=sys.stderr)
    return 0
