"""Mixture-of-experts weights between the trainer's names and vLLM's loader, for the vLLM weight target.

transformers 5 keeps each MoE layer's experts as two fused tensors, ``<layer>.mlp.experts.gate_up_proj``
[experts, 2 x moe_intermediate, hidden] (each expert's gate rows, then its up rows) and
``<layer>.mlp.experts.down_proj`` [experts, hidden, moe_intermediate], while the checkpoints it writes and
reads keep one tensor per expert (``<layer>.mlp.experts.<e>.gate_proj.weight`` ...) and converts on load
(``transformers.conversion_mapping``, ``MergeModulelist`` + ``Concatenate``). The trainer pushes the
tensors its HF model holds, so the fused ones, while the vLLM target's specs come from the checkpoint.

So the target lists the fused names (what a push must cover, checked whole) in place of the per-expert ones
wherever the HF model of the served checkpoint holds them (:func:`hf_parameter_names` builds it on the meta
device to find out), and hands vLLM's ``load_weights`` the checkpoint's per-expert names, as views of the
fused tensors (:meth:`FusedExperts.split`, no copy): the format every vLLM release loads. The checkpoint's
tensors a version does not carry (read from disk) are joined into the fused layout the same way
transformers does (:meth:`FusedExperts.join`), so the target's host copy is in one naming throughout.

Handled: checkpoints that name experts ``...experts.<e>.{gate,up,down}_proj.weight`` (Qwen2/3-MoE, OLMoE,
DeepSeek, GLM-4.5 and the other families transformers maps as ``qwen2_moe``). Mixtral's ``w1/w2/w3``
layout is not mapped here yet: its per-expert names stay in the specs, which a trainer sending fused
tensors does not match, and the push is refused by name.

Worked example::

    specs, fused = fuse_expert_specs(checkpoint_specs(path, dtype), hf_parameter_names(path))
    fused["model.layers.0.mlp.experts.gate_up_proj"].split(tensor)   # -> (experts.0.gate_proj.weight, view), ...
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.utils.logging import get_logger

log = get_logger(__name__)

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
# fused name -> the per-expert projections concatenated along dim 0 of each expert's slice, in order
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class FusedExperts:
    """One fused expert tensor of the HF model and the checkpoint tensors it is made of.

    ``parts[e]`` names expert e's checkpoint tensors, stacked along dim 0 of ``fused[e]``.
    """

    name: str
    parts: tuple[tuple[str, ...], ...]

    def split(self, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's per-expert tensors, as views of ``tensor``."""
        for expert, names in enumerate(self.parts):
            yield from zip(names, tensor[expert].chunk(len(names), dim=0), strict=True)

    def join(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fused tensor from the checkpoint's per-expert ``tensors`` (transformers' own layout)."""
        return torch.stack([torch.cat([tensors[n] for n in names], dim=0) for names in self.parts])


def has_per_expert_tensors(names: Iterable[str]) -> bool:
    return any(_PER_EXPERT.match(n) for n in names)


def fuse_expert_specs(specs: Specs, hf_names: set[str] | None) -> tuple[Specs, dict[str, FusedExperts]]:
    """``specs`` with each group of per-expert tensors whose fused name is in ``hf_names`` replaced by the
    fused tensor's spec; and those fused tensors by name. ``hf_names`` None: nothing is fused."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for name in specs:
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["expert"])] = name
    out, fused = dict(specs), {}
    for prefix, projs in groups.items():
        for fused_leaf, members in _FUSED.items():
            name = f"{prefix}.{fused_leaf}"
            if not hf_names or name not in hf_names or any(p not in projs for p in members):
                continue
            experts = sorted(projs[members[0]])
            if any(sorted(projs[p]) != experts for p in members) or experts != list(range(len(experts))):
                continue
            parts = tuple(tuple(projs[p][e] for p in members) for e in experts)
            first = [specs[n][0] for n in parts[0]]
            shape = (len(experts), sum(s[0] for s in first), *first[0][1:])
            dtype = specs[parts[0][0]][1]
            for names in parts:
                for n in names:
                    del out[n]
            out[name] = (shape, dtype)
            fused[name] = FusedExperts(name, parts)
    return out, fused


def hf_parameter_names(model_dir: str | Path, trust_remote_code: bool = False) -> set[str] | None:
    """The parameter names of the HF causal LM the checkpoint in ``model_dir`` loads into (built on the meta
    device: no memory, no weights read), or None when transformers cannot build it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        return {name for name, _ in model.named_parameters()}
    except Exception as exc:  # noqa: BLE001 - a model transformers cannot build keeps the checkpoint's names
        log.warning(
            "%s: no HF model to read fused expert names from (%s); checkpoint names kept", model_dir, exc
        )
        return None


def split_fused(
    named: Iterable[tuple[str, torch.Tensor]], fused: dict[str, FusedExperts]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` in checkpoint names: each fused tensor as its per-expert views, the rest as they are."""
    for name, tensor in named:
        if name in fused:
            yield from fused[name].split(tensor)
        else:
            yield name, tensor


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Put the expert weights of vLLM's CPU build back into its kernel's layout after an in-place reload;
    returns how many MoE layers it repacked.

    vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) reads w13/w2 prepacked into its grouped-gemm layout,
    which ``process_weights_after_loading`` of the kernel's experts does on the first load. An in-place reload
    (our weight updates: ``reload_weights``) goes through ``UnquantizedFusedMoEMethod._setup_kernel`` with
    the kernel already built, which copies the new weights in and skips that step (vLLM 0.32), so the
    kernel then reads checkpoint-layout weights as prepacked ones: reloading the very same checkpoint moved
    the tiny Qwen3-MoE's logprobs by 0.03. This runs the skipped step. A kernel that pads the intermediate
    size (it would pad twice here) is refused rather than served wrong.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU kernels
        return 0
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise NotImplementedError(
                f"vLLM's CPU MoE kernel pads this model's expert intermediate size "
                f"({cfg.intermediate_size_per_partition}): in-place weight updates of it are not supported"
            )
        experts.process_weights_after_loading(module)
        done += 1
    return done
