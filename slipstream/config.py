"""The typed configuration tree: one source of truth for every process of a run.

Each role keeps the config of its own parts next to its code (``slipstream/<role>/config.py``); this module
assembles them into the root :class:`Config`, loads YAML presets, applies dotted ``key=value`` overrides
and turns every validation failure into one :class:`ConfigError` that names the key and what was expected.
Every field says what it means in ``Meta(description=...)``; config_doc.py reads those for ``--help``,
docs/config.md and the JSON schema. No role imports this module: :func:`rollouter_settings` and
:func:`trainer_settings` build each role's typed settings from the tree, and the pipeline hands them down.

Why msgspec rather than a hand-written validator: ``msgspec.convert`` already checks types, ``Literal``
choices and ``Meta`` bounds, rejects unknown keys (``forbid_unknown_fields``) and reports the exact path of
the first problem; we only reword its message for people and add a "did you mean" hint
(:func:`~slipstream.config_base.validate`). What it lets through we check: ``inf``/``nan`` floats
(:func:`~slipstream.config_base.check_finite`), and in presets a key written twice (PyYAML keeps the last
one silently) or an empty file.

Worked example::

    cfg = load_config("configs/quickstart.yaml", ["trainer.lr=2e-5", "async.mode=sync"])
    cfg.trainer.lr            # 2e-05
    trainer_settings(cfg).sampling_temperature   # rollout.sampling.temperature, typed for the trainer
    load_config(None, ["trainer.lrr=1"])
    # ConfigError: trainer.lrr: unknown key; did you mean `lr`? (valid keys under `trainer`: ...)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from slipstream.agents.config import AgentConfig, DataConfig, DataGenConfig, RewardConfig
from slipstream.config_base import (
    ConfigError,
    ConfigStruct,
    ModelConfig,
    RunConfig,
    checked,
    override_value,
    validate,
)
from slipstream.queue.config import QueueConfig
from slipstream.rollouter.config import EvalConfig, RolloutConfig
from slipstream.rollouter.settings import RollouterSettings
from slipstream.trainer.config import TrainerConfig
from slipstream.trainer.settings import TrainerSettings
from slipstream.utils.versions import versions_behind
from slipstream.weightsync.config import WeightSyncConfig

__all__ = [
    "AsyncConfig",
    "AutotuneBounds",
    "Config",
    "ConfigError",
    "ConfigStruct",
    "DataGenConfig",
    "ModelConfig",
    "RunConfig",
    "load_config",
    "override_value",
    "rollouter_settings",
    "to_dict",
    "to_yaml",
    "trainer_settings",
    "versions_behind",
]


Mode = Literal["sync", "one_step_off", "fully_async"]


class AutotuneBounds(ConfigStruct):
    """The box the autotune controller moves the knobs in; checked against each other and against
    ``async.max_staleness`` at config check (pipeline/modes.py)."""

    staleness_cap: Annotated[
        int,
        Meta(
            ge=0,
            description="Trained groups never older than this many weight versions (pushes): the controller "
            "only raises `staleness_threshold` or `sync_every` with room under it, and backs off when "
            "`trainer/staleness_versions_max` reaches it. At most `async.max_staleness`.",
        ),
    ] = 2
    staleness_threshold_max: Annotated[
        float, Meta(ge=0.0, description="Highest `async.staleness_threshold` the controller may set.")
    ] = 2.0
    sync_every_min: Annotated[int, Meta(ge=1, description="Lowest `async.sync_every` it may set.")] = 1
    sync_every_max: Annotated[int, Meta(ge=1, description="Highest `async.sync_every` it may set.")] = 4
    concurrency_min: Annotated[
        int, Meta(ge=1, description="Lowest `rollout.max_concurrent_per_server` it may set.")
    ] = 1
    concurrency_max: Annotated[
        int, Meta(ge=1, description="Highest `rollout.max_concurrent_per_server` it may set.")
    ] = 256
    mismatch_cap: Annotated[
        Annotated[float, Meta(ge=0.0)] | None,
        Meta(
            description="Highest train-inference mismatch (`trainer/approx_kl_behaviour`) the controller "
            "accepts: above it, it lowers `staleness_threshold` and never raises it; null: no cap.",
        ),
    ] = None


class AsyncConfig(ConfigStruct):
    """The knobs users tune to trade freshness for throughput (design.md §3, docs/tuning.md).

    ``mode`` is a preset of the same code path:
      * ``sync``: the rollouter admits exactly one batch per weight version and waits for it to be trained
        (staleness 0); the baseline every speed-up is measured against.
      * ``one_step_off``: generation of step k+1 overlaps training of step k (staleness ≤ 1).
      * ``fully_async``: admission is bounded by ``staleness_threshold``; weights are pushed every
        ``sync_every`` trainer steps while generation continues (partial rollouts).
    """

    mode: Annotated[
        Mode,
        Meta(
            description="Preset of the one code path: `sync` (one batch per weight version, staleness 0; "
            "the baseline), `one_step_off` (generation of step k+1 overlaps training of step k) or "
            "`fully_async` (admission bounded by `staleness_threshold`, pushes every `sync_every` steps "
            "while generation goes on).",
        ),
    ] = "fully_async"
    staleness_threshold: Annotated[
        float,
        Meta(
            ge=0.0,
            description="Admission control: the rollouter may start at most (1 + staleness_threshold) * "
            "batch_groups * sync_every groups per weight version (verl's budget; AReaL's "
            "max_head_offpolicyness in batches).",
        ),
    ] = 0.5
    max_staleness: Annotated[
        int,
        Meta(
            ge=0,
            description="Hard cap, in weight versions (pushes), checked by the trainer when it takes a "
            "group: the pushes made since the oldest token of the group was generated, (trainer step - "
            "min(token versions)) // sync_every. With sync_every k a version spans k trainer steps, so the "
            "cap is max_staleness * k steps.",
        ),
    ] = 4
    stale_policy: Annotated[
        Literal["drop", "keep"],
        Meta(
            description="What the trainer does with a group over `max_staleness`: `drop` it (the prompt is "
            "generated again) or `keep` it (train on it; the off-policy correction handles the gap).",
        ),
    ] = "drop"
    max_stale_drops: Annotated[
        int,
        Meta(
            ge=0,
            description="Times one prompt may be dropped as too stale: its next group is marked to be "
            "trained on whatever its staleness (rollouter/stale_kept_groups counts them), so a prompt whose "
            "responses always take longer than the cap to generate is not regenerated forever.",
        ),
    ] = 2
    sync_every: Annotated[int, Meta(ge=1, description="Trainer steps between weight pushes.")] = 1
    partial_rollout: Annotated[
        Literal["abort", "in_place", "off"],
        Meta(
            description="In-flight requests at a weight push: `abort` (return partial tokens, re-submit "
            "prompt + partial after the update, KV recomputed), `in_place` (generation pauses and continues "
            "on the old KV cache; vLLM recomputes it under the new weights), or `off` (wait for in-flight "
            "requests to finish before the update). No request started after a push reuses cache of an older "
            "version.",
        ),
    ] = "abort"
    autotune: Annotated[
        Literal["off", "throughput"],
        Meta(
            description="Closed-loop tuning of `staleness_threshold`, `sync_every` and "
            "`rollout.max_concurrent_per_server` during the run (pipeline/autotune.py, docs/tuning.md): `off`, "
            "or `throughput` (every `autotune_every` steps, move the knobs toward fewer idle seconds, within "
            "`autotune_bounds`; each change is logged with the measurement that caused it). In `slipstream train` "
            "only the threshold moves (sync_every and the concurrency stay as configured, with a warning); the "
            "simulator moves all three (`slipstream simulate --autotune-eval`).",
        ),
    ] = "off"
    autotune_every: Annotated[
        int, Meta(ge=1, description="Trainer steps between two decisions of the autotune controller.")
    ] = 4
    autotune_bounds: Annotated[
        AutotuneBounds,
        Meta(description="What the autotune controller may never exceed (`async.autotune` other than off)."),
    ] = msgspec.field(default_factory=lambda: AutotuneBounds())

    def staleness(self, trainer_step: int, min_version: int) -> int:
        """Weight versions (pushes) between the oldest token of a group and the trainer at ``trainer_step``:
        tokens stamped with step 8 are 0 versions old at steps 8-11 and 1 at step 12 when sync_every is 4."""
        return versions_behind(trainer_step, min_version, self.sync_every)

    def with_preset(self) -> tuple[AsyncConfig, list[str]]:
        """This section with its mode's preset applied (``MODE_PRESETS``, the one place a preset is written),
        and one note per value the preset changed (``async.sync_every: 4 -> 1 (mode sync)``). Idempotent: the
        pipeline applies it when it prepares the run's config, the rollouter's settings and the simulator's
        gate when they are built from a config that was not prepared."""
        preset = MODE_PRESETS[self.mode]
        notes = [
            f"async.{key}: {getattr(self, key)!r} -> {value!r} (mode {self.mode})"
            for key, value in preset.items()
            if getattr(self, key) != value
        ]
        return msgspec.structs.replace(self, **preset), notes


# async.mode -> the async fields it fixes (fields it leaves out keep the configured value)
MODE_PRESETS: dict[str, dict[str, Any]] = {
    "sync": {"staleness_threshold": 0.0, "sync_every": 1, "partial_rollout": "off"},
    "one_step_off": {"staleness_threshold": 1.0, "sync_every": 1},
    "fully_async": {},
}


class WandbConfig(ConfigStruct):
    """Metrics logging; every run also writes a local metrics.jsonl."""

    mode: Annotated[
        Literal["offline", "online", "disabled"],
        Meta(
            description="wandb mode: `offline` (files under the run directory, sync later), `online`, or "
            "`disabled`.",
        ),
    ] = "offline"
    project: Annotated[str, Meta(description="wandb project the run is logged to.")] = "slipstream"
    entity: Annotated[str | None, Meta(description="wandb team or user; null uses your default entity.")] = (
        None
    )
    tags: Annotated[list[str], Meta(description="Tags attached to the wandb run.")] = []


class ClusterConfig(ConfigStruct):
    """Where the parts run. On one machine Ray starts locally; on a cluster it joins `ray_address`."""

    ray_address: Annotated[
        str | None,
        Meta(
            description="Ray address to join (`auto` on a node started by scripts/launch_*_cluster.sh); "
            "null starts Ray locally.",
        ),
    ] = None
    rollout_resource: Annotated[
        str,
        Meta(
            description="Custom Ray resource that marks the rollout node pool (see "
            "scripts/launch_*_cluster.sh).",
        ),
    ] = "rollout_pool"
    trainer_resource: Annotated[
        str,
        Meta(
            description="Custom Ray resource that marks the trainer node pool (see "
            "scripts/launch_*_cluster.sh).",
        ),
    ] = "trainer_pool"
    restart_servers: Annotated[
        bool,
        Meta(
            description="Restart a dead inference server (re-pushing current weights) instead of failing "
            "the run.",
        ),
    ] = True
    restart_trainer: Annotated[
        bool,
        Meta(
            description="Restart the trainer ranks from the latest checkpoint when one dies, while the "
            "queue, the rollouter and the servers keep running (the queue rolls back what was consumed "
            "since that checkpoint). Off: a dead trainer rank fails the run, and `run.resume` continues it "
            "from the checkpoint in a new run.",
        ),
    ] = False
    max_restarts: Annotated[
        int,
        Meta(
            ge=0,
            description="Restarts allowed per part (each server, the trainer) before its death fails the "
            "run.",
        ),
    ] = 3
    health_interval_s: Annotated[
        float, Meta(gt=0, description="Seconds between health checks of every part.")
    ] = 5.0
    unhealthy_checks: Annotated[
        int,
        Meta(
            ge=1,
            description="A server answering no /health for this many checks in a row is treated as dead "
            "(killed, restarted).",
        ),
    ] = 3
    gpus_per_server: Annotated[
        int,
        Meta(
            ge=0,
            description="GPUs per inference server (its tensor-parallel size); 0 on CPU machines.",
        ),
    ] = 0
    gpus_per_trainer_rank: Annotated[
        int, Meta(ge=0, description="GPUs per trainer rank; 0 on CPU machines.")
    ] = 0
    gpu_memory_gib: Annotated[
        float,
        Meta(
            gt=0,
            description="GiB of memory per GPU, for the memory check before launch (`slipstream plan "
            "memory` shows the estimate).",
        ),
    ] = 80.0
    colocate: Annotated[
        bool,
        Meta(
            description="Trainer ranks and inference servers share GPUs (a one-GPU machine): server i runs "
            "on the GPU of trainer rank i, each taking half of it in Ray's accounting (the engines' own "
            "memory settings split the memory: rollout.embedded / --gpu-memory-utilization). Needs "
            "gpus_per_server = gpus_per_trainer_rank = 1 and no more servers than ranks. Off: the two pools "
            "own separate GPUs (separate nodes on a cluster).",
        ),
    ] = False
    placement_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest wait for the pools' placement groups (every GPU part reserved before any "
            "model loads); a config that cannot fit fails after it, naming what it asked for and what the "
            "cluster has.",
        ),
    ] = 30.0
    server_host: Annotated[
        str,
        Meta(
            description="Address inference servers bind. Loopback by default; on a multi-node cluster set "
            "0.0.0.0 (the pipeline then hands out each server's node address).",
        ),
    ] = "127.0.0.1"
    trainer_threads: Annotated[
        int,
        Meta(
            ge=0,
            description="Torch threads per trainer rank on CPU; 0 divides the cores the CPU inference "
            "servers leave among the ranks (planning/threads.py; `slipstream config check` shows the split). "
            "The servers' threads are rollout.embedded.num_threads and rollout.vllm.cpu_threads.",
        ),
    ] = 0
    start_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest wait for start-up (parts created, models loaded, servers healthy) before "
            "the run fails.",
        ),
    ] = 1800.0
    step_timeout_s: Annotated[
        float,
        Meta(
            gt=0, description="Longest wait for one trainer step (batch wait included) before the run fails."
        ),
    ] = 7200.0
    shutdown_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest wait for the parts to stop at the end of a run before their processes are "
            "killed.",
        ),
    ] = 60.0


class Config(ConfigStruct):
    """The root of the tree; YAML presets in configs/ fill it, `key=value` arguments override it."""

    run: RunConfig = msgspec.field(default_factory=RunConfig)
    datagen: DataGenConfig = msgspec.field(default_factory=DataGenConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    async_: AsyncConfig = msgspec.field(default_factory=AsyncConfig, name="async")
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    # Evaluation on data.val_files during training (off unless eval.every > 0).
    eval_: EvalConfig = msgspec.field(default_factory=EvalConfig, name="eval")
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    weightsync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)


# ------------------------------------------------------------------------------------- role settings
# Each role is built from a settings struct of its own (rollouter/settings.py, trainer/settings.py), never
# from this tree: the functions below are the one place that says which root value reaches which role.
# The queue and weight sync take their own section (cfg.queue, cfg.weightsync) as it is.


def rollouter_settings(cfg: Config) -> RollouterSettings:
    """The rollouter's settings: its sections whole, and the values of other roles it needs (the ``async``
    knobs with their mode's preset applied, ``AsyncConfig.with_preset``, so a config the pipeline did not
    prepare gives the same gate)."""
    knobs = cfg.async_.with_preset()[0]
    return checked(
        RollouterSettings(
            rollout=cfg.rollout,
            data=cfg.data,
            agent=cfg.agent,
            reward=cfg.reward,
            eval_=cfg.eval_,
            model=cfg.model,
            seed=cfg.run.seed,
            mode=knobs.mode,
            staleness_threshold=knobs.staleness_threshold,
            sync_every=knobs.sync_every,
            stale_policy=knobs.stale_policy,
            max_stale_drops=knobs.max_stale_drops,
            batch_groups=cfg.trainer.batch_groups,
            put_timeout_s=cfg.queue.put_timeout_s,
            restart_servers=cfg.cluster.restart_servers,
            health_interval_s=cfg.cluster.health_interval_s,
            return_routes=cfg.trainer.moe.routing_replay == "rollout",
        )
    )


def trainer_settings(cfg: Config) -> TrainerSettings:
    """A trainer rank's settings: its sections whole, and the values of other roles it needs."""
    return checked(
        TrainerSettings(
            trainer=cfg.trainer,
            model=cfg.model,
            run=cfg.run,
            weightsync=cfg.weightsync,
            sampling_temperature=cfg.rollout.sampling.temperature,
            sampling_top_k=cfg.rollout.sampling.top_k,
            sampling_top_p=cfg.rollout.sampling.top_p,
            loss_scale_tokens=cfg.rollout.sampling.max_new_tokens,
            max_staleness=cfg.async_.max_staleness,
            stale_policy=cfg.async_.stale_policy,
            sync_every=cfg.async_.sync_every,
            server_kind=cfg.rollout.backend,
            checkpoint_every=cfg.trainer.checkpoint_every,
        )
    )


# ----------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated :class:`Config` from an optional YAML preset plus dotted overrides.

    A preset may name another with a top-level ``base: other.yaml`` (relative to itself); the preset's keys
    override its base's. Overrides are ``a.b.c=value``; the value is read as YAML when it looks like a list
    or mapping (``[a, b]``, ``{k: v}``) and as a string otherwise, which the typed conversion then coerces
    (``"2e-5"`` → float, ``"true"`` → bool, ``"null"`` → None).
    """
    raw: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(raw)


def from_dict(raw: dict[str, Any], cls: type[msgspec.Struct] = Config) -> Any:
    """Validate a plain mapping into ``cls`` (the root by default); raise :class:`ConfigError` naming the key
    on failure (:func:`~slipstream.config_base.validate`)."""
    return validate(raw, cls)


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    """The config as plain builtins (YAML/JSON-ready), using the names users write (`async`, not `async_`)."""
    return msgspec.to_builtins(cfg)


def to_yaml(cfg: msgspec.Struct) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _read_yaml(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: `base` presets form a cycle")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = _parse_preset(path)
    if data is None:
        raise ConfigError(
            f"{path}: the file is empty; give it at least one section or `base: other.yaml` "
            "(to run on the defaults, give no config file)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base` must be a path to another preset")
    merged = _read_yaml(path.parent / base, (*_seen, path))
    _deep_merge(merged, data)
    return merged


def _parse_preset(path: Path) -> Any:
    """Parse one YAML file, refusing a key written twice in one mapping (PyYAML would keep the last)."""
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    finally:
        loader.dispose()


def _check_unique_keys(root: yaml.Node, path: Path) -> None:
    """Raise naming the dotted key and both lines when a mapping of the parsed tree repeats a key.

    ``<<`` merge keys are skipped: a key written next to one overrides the merged value by design.
    """
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    visited: set[int] = set()
    while stack:
        node, where = stack.pop()
        if id(node) in visited:  # an alias points back at a node already checked
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = f"{where}.{key_node.value}" if where else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(f"{path}: `{key}` is set twice, at lines {lines[key]} and {line}; keep one")
            lines[key] = line
            stack.append((value_node, key))


def _deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ConfigError(f"override `{item}`: expected dotted.key=value, e.g. trainer.lr=1e-5")
    return key, override_value(key, text)


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"{key}: `{where}` is a value, not a section, so it has no key `{parts[i + 1]}`"
            )
        node = child
    node[parts[-1]] = value
