"""The `slipstream` command.

Sub-commands are dispatched lazily: only the module of the command that runs is imported (most of them pull
in torch), so `slipstream --help` is instant. Each target module exposes ``main(argv: list[str]) -> int`` and
builds its own argparse parser from the shared parts in cli_args.py; to add a command, add a row to
``COMMANDS``. The ``config`` commands live here: ``show`` (validate and print), ``docs`` (the key reference,
docs/config.md) and ``schema`` (JSON schema), all generated from the typed configs' descriptions.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help) or {sub-command: (module, help)}
COMMANDS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "train": ("slipstream.pipeline", "train a model: slipstream train CONFIG [key=value ...]"),
    "serve": (
        "slipstream.rollouter.serve",
        "run the embedded inference server: slipstream serve --model PATH",
    ),
    "bench": {
        "queue": ("slipstream.system.bench_queue", "TransferQueue throughput and latency vs Ray and memcpy"),
        "rollout": ("slipstream.system.bench_rollout", "embedded server tokens/s vs transformers generate"),
        "gateway": (
            "slipstream.system.bench_gateway",
            "agent gateway latency overhead and exact recording",
        ),
        "train": ("slipstream.system.bench_train", "training tokens/s, packed vs padded"),
        "logprob": (
            "slipstream.system.bench_logprob",
            "logprob+entropy peak memory, full logits vs chunked",
        ),
        "weightsync": (
            "slipstream.system.bench_weightsync",
            "weight sync GB/s vs raw transport and naive; --target vllm: a push into a generating vLLM",
        ),
        "boundary": (
            "slipstream.system.bench_boundary",
            "the train-inference boundary on real vLLM: fresh caches, whole and verified versions, masks, auth",
        ),
        "moe": (
            "slipstream.system.bench_moe",
            "routing replay on a tiny MoE: logprob error with and without, route mismatch, step overhead",
        ),
        "multimodal": (
            "slipstream.system.bench_multimodal",
            "vision-language RL on a tiny Qwen2-VL: logprob error vs vLLM, image bytes per group, a short run",
        ),
        "served-dtype": (
            "slipstream.system.bench_served_dtype",
            "vLLM's CPU decode tokens/s per dtype, and whether rollout.vllm.dtype auto picks the faster",
        ),
        "e2e": ("slipstream.system.e2e", "samples/s of fully_async vs sync on a long-tail workload"),
        "autotune": ("slipstream.system.bench_autotune", "tokens/s with the autotune controller vs without"),
        "soak": (
            "slipstream.system.soak",
            "a long run with servers and trainers killed: memory, lost groups",
        ),
        "scale": ("slipstream.system.scale", "control plane (queue, rollouter, pushes) at 8-256 servers"),
        "simulate": ("slipstream.sim.bench", "simulated step times vs our runs and verl's figures"),
    },
    "models": {
        "prepare": ("slipstream.rollouter.models", "prepare a known model as a local HF checkpoint"),
    },
    "data": {
        "make": ("slipstream.agents.datagen", "generate a verifiable synthetic dataset"),
    },
    "queue": {
        "serve": ("slipstream.queue.server", "run a TransferQueue server process"),
    },
    "config": {
        "show": ("slipstream.cli", "validate a config and print it resolved; --help lists every key"),
        "check": (
            "slipstream.cli",
            "check a config as `slipstream train` would, and warn about its CPU split",
        ),
        "docs": ("slipstream.cli", "print the key reference (docs/config.md) made from the configs"),
        "schema": ("slipstream.cli", "print the JSON schema of a config file, descriptions included"),
    },
    "plot": ("slipstream.plot", "write PNG curves of a run: slipstream plot RUN_DIR"),
    "profile": ("slipstream.sim.profile", "fit a performance profile to a run: slipstream profile RUN_DIR"),
    "simulate": (
        "slipstream.sim.command",
        "a run in virtual time: slipstream simulate CONFIG --profile P (--autotune-eval: the controller)",
    ),
    "tune": (
        "slipstream.sim.tune",
        "recommend async knobs by simulation: slipstream tune CONFIG --profile P | --from-run RUN",
    ),
    "plan": {
        "memory": ("slipstream.planning.memory", "GPU memory a config needs, per trainer and server GPU"),
        "capacity": ("slipstream.sim.plan", "fastest pool split and async knobs under the staleness cap"),
    },
}

# command group -> the sub-command that takes a first argument naming none of its sub-commands
# (`slipstream plan CONFIG ...` is `slipstream plan capacity CONFIG ...`)
DEFAULT_SUBCOMMANDS: dict[str, str] = {"plan": "capacity"}


def _usage(table: dict, prefix: str) -> str:
    width = max(len(k) for k in table) + 2
    lines = [f"usage: {prefix} <command> [args ...]", "", "commands:"]
    for name, entry in table.items():
        text = entry[1] if isinstance(entry, tuple) else "{" + ",".join(entry) + "}"
        lines.append(f"  {name.ljust(width)}{text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table: dict = COMMANDS
    prefix = "slipstream"
    while True:
        if not argv or argv[0] in ("-h", "--help"):
            print(_usage(table, prefix))
            return 0 if argv else 2
        name = argv.pop(0)
        entry = table.get(name)
        group = prefix.rpartition(" ")[2]
        if entry is None and table is not COMMANDS and group in DEFAULT_SUBCOMMANDS and name[:1] != "-":
            argv.insert(0, name)
            name = DEFAULT_SUBCOMMANDS[group]
            entry = table[name]
        if entry is None:
            print(f"{prefix}: unknown command `{name}`\n\n{_usage(table, prefix)}", file=sys.stderr)
            return 2
        prefix = f"{prefix} {name}"
        if isinstance(entry, tuple):
            break
        table = entry
    module_name = entry[0]
    if module_name == "slipstream.cli":  # also when run as `python -m slipstream.cli`
        return _CONFIG_COMMANDS[name](argv)
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def config_show(argv: list[str]) -> int:
    """`slipstream config show CONFIG [key=value ...]`: validate and print the resolved YAML."""
    from slipstream.cli_args import config_overrides, config_parser
    from slipstream.config import Config, ConfigError, load_config, to_yaml

    parser, keys = config_parser(
        "slipstream config show",
        "Validate a config (a preset plus overrides) and print it resolved, as YAML.",
        Config,
        epilog="Example: slipstream config show configs/quickstart.yaml trainer.lr=2e-5",
    )
    try:
        ns = parser.parse_intermixed_args(argv)
    except SystemExit as stop:  # --help (0) or a bad command line (2)
        return int(stop.code or 0)
    try:
        cfg = load_config(ns.config, [*ns.overrides, *config_overrides(ns, keys)])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0


def config_check(argv: list[str]) -> int:
    """`slipstream config check CONFIG [key=value ...]`: every check `slipstream train` makes before it starts
    anything (keys, values, cross-section rules, model files, installed servers), then the warnings it would
    log (the parts asking for more CPU threads than this machine has cores); exit 1 on an error."""
    from slipstream.cli_args import config_overrides, config_parser
    from slipstream.config import Config, ConfigError, load_config
    from slipstream.pipeline.modes import check_config, config_warnings, prepare_config
    from slipstream.planning.threads import plan_threads

    parser, keys = config_parser(
        "slipstream config check",
        config_check.__doc__.split(": ", 1)[1],
        Config,
        epilog="Example: slipstream config check configs/quickstart.yaml cluster.trainer_threads=2",
    )
    try:
        ns = parser.parse_intermixed_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    try:
        cfg, _ = prepare_config(load_config(ns.config, [*ns.overrides, *config_overrides(ns, keys)]))
        check_config(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 1
    print(plan_threads(cfg).describe())
    for warning in config_warnings(cfg):
        print(f"warning: {warning}")
    print("ok")
    return 0


def config_docs(argv: list[str]) -> int:
    """`slipstream config docs`: the key reference in Markdown (`slipstream config docs > docs/config.md`)."""
    from slipstream.cli_args import command_parser
    from slipstream.config import Config
    from slipstream.config_doc import markdown

    parser = command_parser("slipstream config docs", config_docs.__doc__.split(": ", 1)[1])
    try:
        parser.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    print(markdown(Config), end="")
    return 0


def config_schema(argv: list[str]) -> int:
    """`slipstream config schema`: the JSON schema of a config file, each key's description included, for
    editors that check YAML against a schema."""
    import json

    import msgspec

    from slipstream.cli_args import command_parser
    from slipstream.config import Config

    parser = command_parser("slipstream config schema", "Print the JSON schema of a config file.")
    try:
        parser.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    print(json.dumps(msgspec.json.schema(Config), indent=2))
    return 0


_CONFIG_COMMANDS = {"show": config_show, "check": config_check, "docs": config_docs, "schema": config_schema}


if __name__ == "__main__":
    sys.exit(main())
