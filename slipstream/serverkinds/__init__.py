"""One record per inference-server kind (``rollout.backend``): everything the rest of Slipstream knows of it.

A :class:`ServerKind` holds a kind's API description (``slipstream.serverapi``), how to start one (command and
environment), the rollouter's client class, the weight-sync adapter class and the flags the config checks and
the launcher read. Each kind is one module here (``embedded.py``, ``sglang.py``, ``vllm.py``) that defines its
client and adapter subclasses, its command builder and ``KIND = ServerKind(...)``; :data:`KINDS` names each
module by string and :func:`server_kind` imports one when it is first asked for, so nothing imports every kind
at start-up.

This package sits above the roles: a kind's module builds on the generic bases that stay with them
(``rollouter/clients/base.py``: :class:`ServerClient`; ``weightsync/adapters.py``: :class:`ServerAdapter`;
``serverapi/spec.py``: :class:`ServerAPI`; ``rollouter/launch.py``: starting, watching and stopping a
process), and no role imports it back. The composition roots (the pipeline's launcher and actors, the CLI, the
tools in ``slipstream/system/``, the config checks and planners) call :func:`server_kind` once with the
configured name and hand the record down: ``launch_server(kind, ...)``, ``make_client(kind, url)``,
``WeightPublisher(cfg, urls, kind)``, each typed by a small protocol its own module defines (``LaunchKind``,
``ClientKind``, ``AdapterKind``), which the record satisfies.

To add a kind (``docs/architecture.md``, "Adding a server kind"; ``tests/test_serverkinds.py`` checks it):

1. its API description: a :class:`~slipstream.serverapi.ServerAPI` instance (``serverapi/<kind>.py`` for a
   third-party server; for ``make contracts`` to check it against its pinned release, its pin and launch
   spec in ``contracts/pins.py`` and ``contracts/flags.py``);
2. ``serverkinds/<kind>.py``: a :class:`ServerClient` subclass, a :class:`ServerAdapter` subclass (each with
   the description as its ``default_api`` / ``api``), the command builder and ``KIND = ServerKind(...)``;
3. one line in :data:`KINDS`, its name in :data:`KindName` (the choices of ``rollout.backend`` and
   ``reward.service.launch.backend``; written in ``serverapi/spec.py``, below the configs that name it), and
   its pip extra in ``pyproject.toml``.

Example::

    kind = server_kind("vllm")
    kind.command("/models/m", "127.0.0.1", 8000, rollout_cfg)   # ["python", "-m", "vllm...", ...]
    kind.client("http://127.0.0.1:8000", server_api=kind.api)
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.serverapi.spec import KindName
from slipstream.utils.registry import UnknownNameError

if TYPE_CHECKING:
    from slipstream.config import Config
    from slipstream.rollouter.clients.base import ServerClient
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.serverapi.spec import ServerAPI
    from slipstream.weightsync.adapters import ServerAdapter

# The one table of kinds: name (``rollout.backend``) -> the module defining its ``KIND``, in the order
# error messages list them.
KINDS: dict[str, str] = {
    "embedded": "slipstream.serverkinds.embedded",
    "sglang": "slipstream.serverkinds.sglang",
    "vllm": "slipstream.serverkinds.vllm",
}


def _no_env(cfg: RolloutConfig) -> dict[str, str]:
    return {}


def _never(cfg: RolloutConfig) -> bool:
    return False


def _no_setting(cfg: RolloutConfig) -> str:
    return ""


def _always(cfg: RolloutConfig) -> bool:
    return True


def _no_cpu_threads(cfg: RolloutConfig) -> int | None:
    return None


_DTYPE_ALIASES = {"half": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
_DTYPES = ("float32", "bfloat16", "float16")


def args_or_checkpoint_dtype(cfg: RolloutConfig, model_path: str, model_dtype: str) -> str:
    """The dtype a third-party server holds weights in when nothing of ours sets it: a ``--dtype=...`` in
    ``rollout.server_args`` (appended last, so it wins), else the checkpoint's ``torch_dtype`` (vLLM's and
    SGLang's ``auto``), else ``model.dtype``."""
    for arg in cfg.server_args:
        key, _, value = arg.partition("=")
        if key == "--dtype" and _DTYPE_ALIASES.get(value, value) in _DTYPES:
            return _DTYPE_ALIASES.get(value, value)
    config = Path(model_path).expanduser() / "config.json"
    if config.is_file():
        hf = json.loads(config.read_text())
        found = hf.get("torch_dtype") or hf.get("dtype")
        if found in _DTYPES:
            return found
    return model_dtype


@dataclass(frozen=True)
class ServerKind:
    """What Slipstream knows of one inference-server kind (module docstring)."""

    name: str
    """The ``rollout.backend`` string."""
    api: ServerAPI
    """Its HTTP API: routes, pause modes, abort ids, the weight-update sequence, the pinned release."""
    client: type[ServerClient]
    """The rollouter's client class (built with ``server_api=api``)."""
    adapter: type[ServerAdapter]
    """The weight-sync adapter class (its ``api`` is this kind's description, its ``kind`` this name)."""
    command: Callable[[str, str, int, RolloutConfig], list[str]]
    """(model path, host, port, rollout config) -> the argv that starts one server (without the position
    override, ``rollout.server_args`` and extra arguments, which :meth:`argv` and the launcher add)."""
    env: Callable[[RolloutConfig], dict[str, str]] = _no_env
    """(rollout config) -> the environment its servers start with, beyond ours."""
    module: str | None = None
    """The Python module that must be importable to launch one here; None for ours (always there)."""
    extra: str | None = None
    """The ``pyproject.toml`` extra that installs it (``pip install 'slipstream[<extra>]'``)."""
    title: str = ""
    """Its name in prose ("vLLM")."""
    local_model_only: bool = False
    """Whether it loads only a local HF checkpoint directory (ours), not a hub name."""
    needs_gpus: bool = True
    """Whether its servers need GPUs (``cluster.gpus_per_server``, judges' ``gpus_per_server``)."""
    cpu_build: Callable[[], bool] | None = None
    """Whether the build installed here runs without GPUs (vLLM's CPU build), where the kind has one."""
    cpu_extra: str | None = None
    """The extra of that CPU build."""
    context_flag: str | None = None
    """The server flag that sets the longest sequence it accepts (checked against the config's lengths)."""
    position_flag: str | None = None
    """The server flag (a JSON object) that overrides fields of the model's HF config; where None,
    ``rollout.max_position_embeddings`` is refused."""
    open_flag: str | None = None
    """The flag that starts it without a token when none is set (ours: ``--open``)."""
    typed_buckets: bool = False
    """Whether its receiver builds each ``torch_dist`` bucket as one typed tensor, so over NCCL the sender
    must send the same datatype (SGLang); else the bucket travels as bytes."""
    streams: tuple[str, ...] = ()
    """The in-band weight streams (``weightsync.backend`` ``ipc``, ``nixl``) its servers take."""
    colocated_transports: tuple[str, ...] = ()
    """The ``weightsync.backend`` values that can push to one of its servers on its trainer rank's own GPU
    (``cluster.colocate``); empty: none can."""
    colocated_missing: str = ""
    """Where none can: the one-GPU weight path it lacks, for the error."""
    rebuilds_send_less: bool = False
    """Whether its servers can rebuild the weights from LoRA-adapter and delta versions
    (``weightsync/send_less.py``, our receiver) under some setting; where False a LoRA run pushes merged
    full versions and ``weightsync.delta`` is refused. Which setting: :attr:`takes_send_less`."""
    send_less_missing: str = ""
    """Where it cannot: why, for the start-up log and the errors."""
    takes_send_less: Callable[[RolloutConfig], bool] = _never
    """(rollout config) -> whether its servers rebuild them under this config; each server's adapter says
    so again once it is linked (``ServerAdapter.send_less_refusal``: servers started by hand)."""
    transfer_setting: Callable[[RolloutConfig], str] = _no_setting
    """The config that decides :attr:`takes_send_less`, in words for an error (" with ... `nccl`")."""
    unfiltered_logprobs: Callable[[RolloutConfig], str] = _no_setting
    """(rollout config) -> why the logprobs its servers return under this config are not of the distribution
    they sample from when top-k / top-p is on (renormalised over the kept tokens), for the config check's
    refusal; empty where they are (``trainer/logprobs.py``, "Sampling masks")."""
    served_dtype: Callable[[RolloutConfig, str, str], str] = args_or_checkpoint_dtype
    """(rollout config, ``model.path``, ``model.dtype``) -> the dtype its servers hold weights in (what
    ``weightsync.push_dtype: auto`` pushes and the memory planner counts)."""
    kv_cache_tokens: Callable[[RolloutConfig], int] | None = None
    """Where its servers size their memory from their own engine config (ours): (rollout config) -> the KV
    cache, in tokens, a server allocates beside its weights; the memory planner counts those, the cache and
    a reserve, and a colocated trainer gets the rest of the GPU. None: a server takes a fraction of the GPU
    (``--gpu-memory-utilization`` / ``--mem-fraction-static``, 0.9) as its limit and fills what its weights
    leave with cache."""
    on_gpu: Callable[[RolloutConfig], bool] = _always
    cpu_threads: Callable[[RolloutConfig], int | None] = _no_cpu_threads
    """(rollout config) -> the compute threads one of its servers runs on a CPU (0: one per core), what the
    thread plan adds up (``planning/threads.py``) and the launcher puts in ``OMP_NUM_THREADS``; None where its
    servers compute on a GPU under this config."""
    cpu_threads_key: str = ""
    """The config key that sets :attr:`cpu_threads` (named by the thread plan's warnings)."""
    """(rollout config) -> whether its servers hold their weights on a GPU (the memory planner counts one)."""

    def __repr__(self) -> str:
        return f"ServerKind({self.name!r})"

    def argv(self, model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
        """The command that starts one server, with ``rollout.max_position_embeddings`` as its override."""
        return self.command(model, host, port, cfg) + self.position_override(cfg)

    def position_override(self, cfg: RolloutConfig) -> list[str]:
        if cfg.max_position_embeddings is None or self.position_flag is None:
            return []
        return [self.position_flag, json.dumps({"max_position_embeddings": cfg.max_position_embeddings})]

    def runs_without_gpus(self) -> bool:
        """Whether its servers can run here without GPUs (ours, or a CPU build installed)."""
        return not self.needs_gpus or (self.cpu_build is not None and self.cpu_build())


def server_kind(name: str, *, key: str = "") -> ServerKind:
    """The record of kind ``name``, its module imported on first use; an ``UnknownNameError`` (a ValueError)
    naming ``key`` (default ``rollout.backend``) and the known kinds otherwise."""
    if name not in KINDS:
        known = ", ".join(KINDS)
        key = key or "rollout.backend"
        raise UnknownNameError(f"{key}: unknown inference server kind `{name}`; known kinds: {known}")
    module = importlib.import_module(KINDS[name])
    kind: ServerKind = module.KIND
    if kind.name != name:
        raise ValueError(f"{module.__name__}.KIND is named `{kind.name}`, but KINDS lists it as `{name}`")
    return kind


def served_dtype(cfg: Config) -> str:
    """The dtype the inference servers hold weights in (what ``weightsync.push_dtype: auto`` pushes, what the
    memory planner counts): a value of the whole config, read from the configured kind's own settings (its
    record's ``served_dtype``)."""
    return server_kind(cfg.rollout.backend).served_dtype(cfg.rollout, cfg.model.path, cfg.model.dtype)


def kind_names() -> list[str]:
    """Every registered kind, in table order (nothing imported)."""
    return list(KINDS)


__all__ = [
    "KINDS",
    "KindName",
    "ServerKind",
    "args_or_checkpoint_dtype",
    "kind_names",
    "served_dtype",
    "server_kind",
]
