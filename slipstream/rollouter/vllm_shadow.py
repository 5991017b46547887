"""A second copy of a vLLM model on a CPU, loaded while the first serves, so a weight switch only swaps them.

vLLM's in-place reload (``reload_weights``) rebuilds every layer and re-runs its post-load processing, which
on its CPU build packs each linear layer's weight for the GEMM kernel (oneDNN handlers, ``cpu_linear``):
0.3-1.2 s for SmolLM2-135M in bf16 on the 2-core machine, measured in the reload itself (``create_onednn_mm``
half of it, the copies most of the rest), and all of it inside the pause, when vLLM generates nothing. A
:class:`Shadow` holds a second copy of the model's modules (a ``deepcopy`` sharing every tensor that is not a
parameter or buffer: the KV cache), reloads the next version into it off the pause, and the switch then
exchanges the two copies' parameters, buffers and packed kernels module by module: pointer swaps, taking
milliseconds. The copy that served becomes the shadow, into which the version after loads.

Where it applies (:func:`shadow_supported`): a model on the CPU (on a GPU the reload is a device copy, and
CUDA graphs hold the parameters' addresses, so vLLM's in-place reload stays), without fused experts (vLLM's
CPU MoE kernel keeps its packed weights inside kernel objects that refer back to their layer, which a swap of
the layer's attributes would not carry: ``rollouter/vllm_moe.py`` repacks them in place instead) and without
LoRA layers. Elsewhere, and whenever the copy cannot be made, the target reloads in place as before. The
cost: host memory for one more copy of the served weights.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator

import torch

from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Module attributes that are the module's structure or hooks, never swapped.
_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "training"})
# What a layer's post-load processing leaves on it besides parameters and buffers: packed kernels bound as
# functions (``cpu_linear``) and tensors it keeps (an unpacked copy of a conv weight).
_KERNEL_TYPES = (types.FunctionType, types.MethodType, functools.partial, torch.Tensor)


def shadow_supported(model: torch.nn.Module, vllm_config) -> str:
    """Why ``model`` cannot be double-buffered ("" when it can; module docstring)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA layers"
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase):
            return "fused experts"
        for param in module.parameters(recurse=False):
            if param.device.type != "cpu":
                return f"parameters on {param.device.type}"
    return ""


class Shadow:
    """A second copy of ``model``'s modules, loaded off the pause and swapped in at the switch."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.copy = _copy_sharing_state(model)
        self.pairs = list(zip(model.modules(), self.copy.modules(), strict=True))
        _inherit_reload_metadata(self.pairs)
        self.version: int | None = None  # the version loaded into the copy, not yet swapped in

    def load(self, vllm_config, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Reload ``weights`` (checkpoint format) into the copy while the model serves."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        self.version = None
        with torch.no_grad(), set_current_vllm_config(vllm_config):
            reload_weights(vllm_config, self.copy, weights, None, is_checkpoint_format=True)
        self.version = version

    def swap(self) -> None:
        """Exchange the copy's state with the model's, module by module (the server is paused)."""
        for live, other in self.pairs:
            live._parameters, other._parameters = other._parameters, live._parameters
            live._buffers, other._buffers = other._buffers, live._buffers
            for name in _kernel_attributes(live, other):
                a, b = live.__dict__.get(name), other.__dict__.get(name)
                _set(live, name, b)
                _set(other, name, a)
        self.version = None


def _copy_sharing_state(model: torch.nn.Module) -> torch.nn.Module:
    """``deepcopy(model)`` that shares every tensor held outside parameters and buffers (the KV cache views
    the attention layers keep), so only the weights are duplicated."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for name, value in module.__dict__.items():
            if name in _STRUCTURE:
                continue
            for tensor in _tensors_in(value):
                memo[id(tensor)] = tensor
    return copy.deepcopy(model, memo)


def _tensors_in(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _inherit_reload_metadata(pairs: list[tuple[torch.nn.Module, torch.nn.Module]]) -> None:
    """vLLM keeps what a reload restores each layer from (recorded at the first load) in a table keyed by the
    layer: the copy's layers take their originals' entries."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for live, other in pairs:
        ours, theirs = get_layerwise_info(other), get_layerwise_info(live)
        ours.restore_metadata = theirs.restore_metadata
        ours.restore_device = theirs.restore_device


def _kernel_attributes(live: torch.nn.Module, other: torch.nn.Module) -> list[str]:
    names = (set(live.__dict__) | set(other.__dict__)) - _STRUCTURE
    return sorted(
        n
        for n in names
        if not n.startswith("_forward") and not n.startswith("_backward") and not n.startswith("_state_dict")
        if isinstance(live.__dict__.get(n), _KERNEL_TYPES) or isinstance(other.__dict__.get(n), _KERNEL_TYPES)
        if live.__dict__.get(n) is not other.__dict__.get(n)
    )


def _set(module: torch.nn.Module, name: str, value) -> None:
    if value is None:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = value
