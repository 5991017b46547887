"""Slipstream's weight-transfer engine inside vLLM: our staged, bucketed pushes through vLLM's own routes.

vLLM 0.32+ chooses the engine that receives weights with ``--weight-transfer-config {"backend": NAME}``
and lets packages add engines (``WeightTransferEngineFactory.register_engine``); this package's
``vllm.general_plugins`` entry point (:func:`register`, run in every vLLM process) adds ``slipstream``.
The trainer then drives vLLM with its usual dev-mode sequence, and each call lands here, in the worker:

  ``/init_weight_transfer_engine {init_info}``  → join the trainer's group (gloo on CPU, NCCL on GPU)
  ``/start_weight_update``                      → start receiving a version in band, and return: its
                                                  buckets arrive while vLLM keeps generating
  ``/update_weights {"slipstream_switch": true}`` → (sent with generation paused) wait for the last
                                                  buckets and apply the whole version at once
  ``/finish_weight_update {weight_version}``    → vLLM publishes the version (one that was not switched
                                                  to is discarded here, and no version is published)

Why the buckets arrive beside generation, in band: vLLM calls the engine from its engine loop, between two
model steps, and no step runs until the call returns. Receiving a bucket inside a call would stop every
running request for the whole transfer (27-32 s for the quickstart's fp32 model on a 2-core machine,
measured before this engine staged in the background), and even a call per bucket that only queues it costs
one model step's wait each before vLLM picks it up (0.04-2.4 s a call on a busy CPU server). So
``start_weight_update`` starts one receive of the whole version on the engine's own thread, over the group:
each bucket's metadata travels beside its bytes (torch_dist's store channel, ``weightsync/torch_dist.py``),
the trainer sends without waiting for any call, and generation stops only for the switch
(``docs/benchmarks.md``, "Pushes into vLLM"). A version that fails part way (the trainer aborts it, a bucket
fails verification, the group breaks) fails the switch, where vLLM closes its update session.

The receiving logic is the embedded server's (:class:`~slipstream.weightsync.http_receiver.WeightReceiver`):
one implementation of staging, checks and atomic apply for every server kind. Why not vLLM's ``nccl``
engine: it loads each chunk into the live model as it arrives (layerwise reload), so a push cut short
leaves layers of two versions, and it needs NCCL, which a CPU does not have. Here a version that fails
part way is discarded and the old one keeps serving (vLLM's worker also closes its session).

The version is applied by an ``/update_weights`` call (the switch), rather than in ``/finish_weight_update``:
when an update call raises, vLLM's worker closes its update session, but when ``finish_weight_update`` raises
the session stays open and every later ``/start_weight_update`` is refused. An apply that fails therefore
fails its ``/update_weights`` call, and a failed version never blocks the next. A version never switched to
(the trainer gave up on it) is discarded by ``finish_weight_update``, which then returns normally: vLLM
closes the session and, since the trainer names no version then, publishes none.

The engine runs the receiver on an event loop of its own (a daemon thread): vLLM calls the engine
synchronously from its worker, while the receiver's waits and watchdog are asyncio.

Worked example (what ``serverkinds/vllm.py``'s ``VLLMAdapter`` sends when the server runs this engine)::

    POST /init_weight_transfer_engine {"init_info": {"master_address": "127.0.0.1", "master_port": 29600,
         "rank_offset": 1, "world_size": 2, "group_name": "slipstream_weights", "backend": "gloo"}}
    POST /start_weight_update                                  # then the buckets, in band, generating
    POST /pause?mode=...
    POST /update_weights {"update_info": {"slipstream_switch": true}}
    POST /finish_weight_update {"weight_version": "3"}
    POST /resume
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch

from slipstream.rollouter.vllm_moe import (
    FusedExperts,
    fuse_expert_specs,
    has_per_expert_tensors,
    hf_parameter_names,
    repack_cpu_experts,
    split_fused,
)
from slipstream.rollouter.vllm_readback import ReadBack, read_back
from slipstream.rollouter.vllm_shadow import Shadow, shadow_supported
from slipstream.serverapi.vllm import DOUBLE_BUFFER_ENV, SWITCH_UPDATE
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

ENGINE_NAME = "slipstream"
T = TypeVar("T")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the ``slipstream`` weight-transfer engine (lazily: the
    engine module is imported only by a server configured to use it), apply our launcher's setting of how
    long vLLM's processes spin while they wait for each other (``vllm_idle.py``), and let Qwen2-VL models
    take images where torchvision is missing (``vllm_vision.py``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from slipstream.rollouter.vllm_idle import apply_spin_setting
    from slipstream.rollouter.vllm_vision import install as serve_images_without_torchvision

    apply_spin_setting()
    serve_images_without_torchvision()
    if ENGINE_NAME in WeightTransferEngineFactory._registry:  # plug-ins may load twice in one process
        return
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__, "SlipstreamWeightEngine")


def checkpoint_specs(
    model_dir: str | Path, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the HF checkpoint in ``model_dir`` by name, with its shape and the serving ``dtype``
    (vLLM fuses q/k/v and gate/up internally, so its own parameter names are not the trainer's)."""
    return {name: (shape, dtype) for name, (shape, _) in _checkpoint_index(model_dir).items()}


def served_specs(model_config, dtype: torch.dtype) -> tuple[dict, dict[str, FusedExperts]]:
    """What a push to this server must name: the checkpoint's tensors, except that an MoE layer's per-expert
    tensors are the HF model's fused ones wherever it holds them (``rollouter/vllm_moe.py``)."""
    specs = checkpoint_specs(model_config.model, dtype)
    if not has_per_expert_tensors(specs):
        return specs, {}
    return fuse_expert_specs(specs, hf_parameter_names(model_config.model, model_config.trust_remote_code))


def _checkpoint_index(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    from safetensors import safe_open

    index: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                index[name] = (tuple(f.get_slice(name).get_shape()), path)
    return index


def _read_checkpoint(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = _checkpoint_index(model_dir)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        with safe_open(str(index[name][1]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


@dataclass
class VLLMTarget:
    """The :class:`~slipstream.weightsync.types.WeightTarget` of one vLLM worker's model.

    ``apply_weights`` checks every name and shape before it loads a byte, then reloads the model in place
    through vLLM's own ``reload_weights`` (checkpoint format: its ``load_weights`` fuses q/k/v and gate/up
    and skips a tied ``lm_head``; the layerwise machinery restores the weight loaders and re-runs any
    post-load processing that the first load replaced).

    That reload rebuilds whole layers, so a version that names only some tensors (a LoRA adapter-only
    version carries the merged projections it adapts, not k_proj beside q_proj and v_proj) is completed
    with the tensors the model holds now: the last value this target applied for each name, else the
    checkpoint's. The target therefore keeps a host copy of what it applied (the model's size, in host
    memory, once the first version arrived). That copy is taken by :meth:`hold`, which the engine runs on a
    thread of its own after the switch, while the server generates again, not inside the pause: the version's
    tensors are views of the staging memory, which the next version's buckets overwrite only after it (the
    next ``start_weight_update`` waits for the copy).
    """

    model: torch.nn.Module
    vllm_config: Any
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    version: int = 0
    tied: frozenset[str] = field(default_factory=lambda: frozenset({"lm_head.weight"}))
    # MoE: the HF model's fused expert tensors the specs list in place of the checkpoint's (rollouter/vllm_moe.py)
    fused: dict[str, FusedExperts] = field(default_factory=dict)
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    to_hold: dict[str, torch.Tensor] = field(default_factory=dict)
    # Double-buffering (rollouter/vllm_shadow.py, rollout.vllm.double_buffer): a second copy loaded off the
    # pause, where the model allows.
    double_buffer: bool = False
    shadow: Shadow | None = None
    prepared: tuple[int, dict[str, torch.Tensor]] | None = None  # checked by prepare_weights, not applied yet
    last_read_back: ReadBack | None = None  # what the last version's read-back compared (vllm_readback.py)

    @property
    def weight_version(self) -> int:
        return self.version

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.specs

    def prepare_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check ``version`` and, where the model can be double-buffered, load it into the shadow copy while
        the old version serves (``rollouter/vllm_shadow.py``), so :meth:`apply_weights` only swaps."""
        self.prepared = None
        weights = self._version_weights(named_tensors)
        shadow = self._shadow()
        if shadow is not None:
            shadow.load(self.vllm_config, list(split_fused(weights.items(), self.fused)), version)
            self._read_back(shadow.copy, weights)  # off the pause: a mismatch refuses the version unserved
        self.prepared = (version, weights)

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared[0] == version:
            weights = prepared[1]
        else:
            weights = self._version_weights(named_tensors)
        if self.shadow is not None and self.shadow.version == version:
            self.shadow.swap()  # the copy loaded off the pause serves now; the old one is the next shadow
        else:
            self._reload_in_place(weights)
            self._read_back(self.model, weights)  # refused before vLLM publishes it; the trainer retries it
        self.to_hold = {n: t for n, t in weights.items() if self.held.get(n) is not t}
        self.version = version

    def _version_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every tensor of the served checkpoint for a version: the ones sent (names and shapes checked, in the
        served dtype), the rest from what this target holds (class docstring)."""
        dtype = self.vllm_config.model_config.dtype
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            spec = self.specs.get(name)
            if spec is None and name not in self.tied:
                raise ValueError(f"`{name}` is not a weight of the served checkpoint")
            if spec is not None and tuple(tensor.shape) != spec[0]:
                raise ValueError(f"`{name}`: sent shape {list(tensor.shape)}, serving {list(spec[0])}")
            weights[name] = tensor.to(dtype)
        missing = [n for n in self.specs if n not in weights]
        unheld = [n for n in missing if n not in self.held]
        from_disk = self._read_checkpoint(unheld) if unheld else {}
        for name in missing:
            weights[name] = self.held[name] if name in self.held else from_disk[name].to(dtype)
        return weights

    def _reload_in_place(self, weights: dict[str, torch.Tensor]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        loaded = list(split_fused(weights.items(), self.fused))  # the checkpoint's names, as vLLM loads them
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, self.model, loaded, None, is_checkpoint_format=True)
            repack_cpu_experts(self.model)  # the step vLLM's reload skips for CPU MoE kernels (vllm_moe.py)

    def _read_back(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Compare what ``model``'s parameters hold with the version (``rollouter/vllm_readback.py``)."""
        report = read_back(model, weights, getattr(self.model, "packed_modules_mapping", None) or {})
        log.debug("%s", report.summary())
        self.last_read_back = report
        report.raise_if_mismatched()

    def _shadow(self) -> Shadow | None:
        """The model's shadow copy, made at the first version that can use one (None where it cannot)."""
        if self.shadow is None and self.double_buffer:
            why = shadow_supported(self.model, self.vllm_config)
            if not why:
                try:
                    self.shadow = Shadow(self.model)
                except Exception as err:  # an attribute that cannot be copied: reload in place instead
                    why = f"the model could not be copied ({type(err).__name__}: {err})"
            if why:
                log.info("weight switches reload the model in place inside the pause: %s", why)
                self.double_buffer = False
        return self.shadow

    def _read_checkpoint(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``names`` (the specs' names) from the served checkpoint, fused expert tensors joined from its parts."""
        parts = [p for n in names if n in self.fused for e in self.fused[n].parts for p in e]
        read = _read_checkpoint(
            self.vllm_config.model_config.model, [n for n in names if n not in self.fused] + parts
        )
        return {n: self.fused[n].join(read) if n in self.fused else read[n] for n in names}

    def hold(self) -> None:
        """Copy what the last version applied into the host copy (class docstring), reusing its buffers."""
        pending, self.to_hold = self.to_hold, {}
        for name, tensor in pending.items():
            kept = self.held.get(name)
            if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype:
                kept.copy_(tensor)
            else:
                self.held[name] = tensor.detach().to("cpu", copy=True)


class _Loop:
    """An asyncio loop on a daemon thread, for calling coroutines from vLLM's synchronous worker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="slipstream-weights", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


def _raise_failed(resp) -> None:
    if not resp.success:
        raise RuntimeError(resp.message)


try:  # the engine class exists only where vLLM does (this module is imported by vLLM's factory)
    _Base = _engine_base()
except ImportError:  # pragma: no cover - imported without vLLM: register() and the target still work
    _Base = object


class SlipstreamWeightEngine(_Base):  # type: ignore[misc, valid-type]
    """vLLM's ``WeightTransferEngine`` interface over our :class:`WeightReceiver` (module docstring)."""

    init_info_cls = dict
    update_info_cls = dict
    # A speculative draft model would need its own target (set_weight_update_target): not supported yet.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        from slipstream.weightsync.config import WeightSyncConfig
        from slipstream.weightsync.http_receiver import WeightReceiver

        super().__init__(config, vllm_config, device, model)
        dtype = vllm_config.model_config.dtype
        specs, fused = served_specs(vllm_config.model_config, dtype)
        double_buffer = os.environ.get(DOUBLE_BUFFER_ENV) == "1"  # rollout.vllm.double_buffer, via the launcher
        self.target = VLLMTarget(model, vllm_config, specs, fused=fused, double_buffer=double_buffer)
        # Whole or nothing, as on the embedded server: a version that should cover every parameter (all but a
        # LoRA adapter-only one) and lacks one is refused, never completed from an older version.
        self.receiver = WeightReceiver(self.target, WeightSyncConfig(require_all_weights=True))
        self._loop = _Loop()
        # The last version's host copy (VLLMTarget.hold), taken on this thread while the server generates.
        self._holder = ThreadPoolExecutor(1, thread_name_prefix="slipstream-hold")
        self._holding: Future[None] | None = None

    def parse_init_info(self, init_dict: dict[str, Any]):
        from slipstream.weightsync.types import InitWeightsUpdateGroupReq

        return _convert(init_dict, InitWeightsUpdateGroupReq, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]):
        from slipstream.weightsync.types import SwitchUpdateReq

        info = _convert(update_dict, SwitchUpdateReq, "update_info")
        if not info.slipstream_switch:
            raise ValueError(
                "the slipstream weight-transfer engine receives buckets in band after /start_weight_update; "
                f"its only /update_weights body is {SWITCH_UPDATE}"
            )
        return info

    def init_transfer_engine(self, init_info) -> None:
        # Every worker of the server joins: its rank is the server's first rank plus its own index across
        # the server's data-parallel replicas (vLLM's own engines count the same way).
        p = self.parallel_config
        worker = p.data_parallel_index * p.world_size + p.rank
        req = msgspec.structs.replace(init_info, rank_offset=init_info.rank_offset + worker)
        _raise_failed(self._loop.run(self.receiver.init_group(req)))

    def start_weight_update(self) -> None:
        """Start receiving the next version in band over the group, and return (module docstring)."""
        from slipstream.weightsync.http_receiver import GROUP_STREAM
        from slipstream.weightsync.types import BeginWeightUpdateReq

        self._wait_held()  # its tensors are views of the staging memory this version overwrites
        _raise_failed(self._loop.run(self.receiver.begin(BeginWeightUpdateReq(stream=GROUP_STREAM))))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device synchronise afterwards (the base class's): the receiver waits for each bucket itself.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info) -> None:
        """The switch (the only update body this engine takes)."""
        self.switch()

    def switch(self) -> None:
        """Wait until the version's last bucket is staged, then apply it whole (the server is paused)."""
        from slipstream.weightsync.types import EndWeightUpdateReq

        started = time.perf_counter()
        _raise_failed(self._loop.run(self.receiver.end(EndWeightUpdateReq())))
        # The host copy, after the pause (VLLMTarget.hold): waited for by the next version's start only.
        self._holding = self._holder.submit(self.target.hold)
        checked = self.target.last_read_back
        log.info(
            "switched to the staged version in %.3f s (digests checked in %.3f s; %s)",
            time.perf_counter() - started,
            self.receiver.last_verify_s,
            checked.summary() if checked is not None else "not read back",
        )

    def finish_weight_update(self) -> None:
        """Nothing left to do after a switch; a version never switched to is discarded (module docstring)."""
        self._discard("the sender finished the update without switching to it")

    def _wait_held(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            holding.result()  # raises the copy's failure (the next version then cannot rely on it)

    def shutdown(self) -> None:
        """The trainer left (vLLM keeps this engine for the next ``init_transfer_engine``): leave its groups,
        which also ends a receive in progress."""
        self._discard("the trainer left")
        self.receiver.close()

    def _discard(self, reason: str) -> None:
        async def on_loop() -> None:  # the receiver's session and its receive task belong to that loop
            self.receiver.discard(reason)

        self._loop.run(on_loop())


def _convert(data: dict[str, Any], cls: type, what: str):
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as err:
        raise ValueError(f"invalid {what} for the slipstream weight-transfer engine: {err}") from err
