"""LoRA for the FSDP2 engine (``trainer.lora``): frozen base weights, trained low-rank adapters.

Each targeted ``nn.Linear`` (by the last part of its module name: ``q_proj``, ``up_proj``, ...) becomes a
:class:`LoRALinear` computing ``x W^T + b + (alpha / r) * dropout(x) A^T B^T``, with A [r, in] initialised as
PEFT does (Kaiming-uniform) and B [out, r] zero, so step 0 is exactly the base model. Everything else is
frozen; the optimizer sees only A and B.

Lifecycle inside ``FSDPEngine`` (``engine/fsdp.py``)::

    model = from_pretrained(...); install_logprob_head(model, ...)      # the chunked output layer
    layers = apply_lora(model, cfg.trainer.lora, seed=cfg.run.seed)    # before fully_shard
    fully_shard(block) ...; fully_shard(model)                          # A and B are sharded like the rest
    with adapters_disabled(model): ...                                  # the base model: the KL reference
    for name, w in merged_named_tensors(model, dtype): ...              # full pushes: W + (alpha/r) B A
    for name, t in adapter_named_tensors(model, dtype): ...             # adapter-only pushes

Invariants: the base weight and bias keep their Hugging Face names (``<module>.weight``) because
:class:`LoRALinear` holds the very same ``Parameter`` objects the ``nn.Linear`` held; adapter tensors are
named ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (``weightsync/delta.py`` maps them to PEFT's
names and merges them on a receiver with the same :func:`~slipstream.weightsync.delta.merge_lora` the
trainer uses here, so both ends compute the same bits).

Why our own layer and not PEFT: PEFT (0.21 on PyPI; not installed here) would compose with FSDP2 itself:
``fully_shard`` shards per parameter, so frozen and trainable parameters can share a block, and the
logprob head could be installed before wrapping since PEFT does not target the output layer by default.
What does not fit is its wrapping: a ``PeftModel`` renames every parameter
(``base_model.model.<name>``, and ``<module>.base_layer.weight`` for each adapted weight), while weight sync,
the DCP checkpoints, the Megatron converters' name maps and every server adapter address weights by their
Hugging Face names; we would translate names at each of those boundaries. It would also add a dependency
whose releases follow transformers' (the vLLM CPU build pins transformers < 5.20). What RL needs from LoRA
is small (one linear layer with two matrices, a switch that turns adapters off for the reference pass, a
merge), so it is written here, and PEFT stays the format adapters are exchanged in (names and
``adapter_config.json``, ``weightsync/delta.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine
from slipstream.weightsync.delta import is_adapter_name, lora_scale, merge_lora

if TYPE_CHECKING:
    from slipstream.trainer.config import LoRAConfig


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trained low-rank update ``(alpha / r) B A``.

    ``enabled = False`` (see :func:`adapters_disabled`) runs the base layer alone.
    """

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: its name stays <module>.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        # PEFT's init (kaiming_uniform_ with a = sqrt(5)), drawn from a seeded generator so every rank
        # builds the same A before sharding; B = 0 makes the adapted model equal the base model at step 0
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            init = torch.rand(self.lora_A.weight.shape, generator=generator, dtype=torch.float32)
            self.lora_A.weight.copy_(init.mul_(2 * bound).sub_(bound))
            self.lora_B.weight.zero_()
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, float(alpha)
        self.scale = lora_scale(alpha, rank)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.rank}, alpha={self.alpha:g}"


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> list[str]:
    """Replace every targeted linear layer of ``model`` by a :class:`LoRALinear`; freeze all else.

    Returns the adapted module names. Raises ``ValueError`` when no module matches ``cfg.target_modules``
    (listing the linear layers the model has) or a match is not an ``nn.Linear``.
    """
    targets = set(cfg.target_modules)
    matches = [(n, m) for n, m in model.named_modules() if n and n.rsplit(".", 1)[-1] in targets]
    if not matches:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"trainer.lora.target_modules {sorted(targets)} match no module of {type(model).__name__}; "
            f"its linear layers: {linear}"
        )
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for name, module in matches:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"trainer.lora: {name} is a {type(module).__name__}, not a linear layer")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, cfg.rank, cfg.alpha, cfg.dropout, gen))
    return [name for name, _ in matches]


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: layer} of every :class:`LoRALinear` in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model (every adapter off) inside the block; restored on exit."""
    layers = list(lora_layers(model).values())
    states = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer, state in zip(layers, states, strict=True):
            layer.enabled = state


def _full(param: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor of a (possibly FSDP2-sharded) parameter; collective when sharded."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param.data).detach()


def merged_named_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the model a server should serve: every base parameter, adapted weights
    merged as ``W + (alpha / r) B A``; adapter tensors themselves are not yielded. Collective over the FSDP
    mesh, in the same order on every rank.

    With ``dtype``, W, A and B are cast to it first and then merged (``merge_lora``: fp32, rounded once to
    ``dtype``): exactly what a server that receives the base weights and the adapters in ``dtype`` computes,
    so a LoRA version served merged and the same version served from adapters are the same bits."""
    layers = {f"{name}.weight": layer for name, layer in lora_layers(model).items()}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None else t

    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        full = cast(_full(param))
        layer = layers.get(name)
        if layer is not None:
            a, b = cast(_full(layer.lora_A.weight)), cast(_full(layer.lora_B.weight))
            full = merge_lora(full, a, b, layer.scale)
        yield name, full
        del full


def adapter_named_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(``<module>.lora_A.weight`` / ``lora_B.weight``, full tensor) of every adapter; collective."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            full = _full(param)
            yield name, (full.to(dtype) if dtype is not None else full)


def describe(cfg: LoRAConfig) -> dict:
    """What a checkpoint records about its adapters, compared on load (a mismatch is an error)."""
    return {"rank": cfg.rank, "alpha": float(cfg.alpha), "target_modules": sorted(cfg.target_modules)}


def check_checkpoint(path: Path, saved: dict | None, cfg: LoRAConfig | None) -> None:
    """Raise ``ValueError`` unless a checkpoint's adapters (``describe`` or None) are the ones ``cfg`` builds:
    a resumed run must not silently load a full model into a LoRA policy, or adapters of another shape."""
    want = describe(cfg) if cfg is not None else None
    if saved == want:
        return
    if want is None:
        raise ValueError(f"{path}: a LoRA checkpoint ({saved}), but trainer.lora.rank is 0")
    if saved is None:
        raise ValueError(f"{path}: a full-model checkpoint, but trainer.lora is set ({want})")
    raise ValueError(f"{path}: LoRA checkpoint of {saved} does not match trainer.lora {want}")


class BaseModelReference(ModelEngine):
    """The KL reference of a LoRA policy without a second model: the policy engine's own forward with every
    adapter switched off, i.e. the frozen base weights, which are the initial policy (B starts at 0).

    Forward only; it shares the policy's process group, shards and micro-batching. Example::

        ref = BaseModelReference(policy_engine)      # what make_aux_engines builds for a LoRA policy
        out = ref.forward_backward_batch(batch, None, forward_only=True)   # out.tokens["logprobs"]
    """

    def __init__(self, policy: ModelEngine) -> None:
        if getattr(policy, "model", None) is None or not lora_layers(policy.model):
            raise ValueError("BaseModelReference needs an initialised policy engine with LoRA adapters")
        self.policy = policy
        self.rank, self.world_size = policy.rank, policy.world_size

    def initialize(self) -> None:
        """Nothing to build: the policy holds the weights."""

    def forward_backward_batch(
        self, data: TensorDict, loss_fn: LossFn | None, forward_only: bool = False
    ) -> EngineOutput:
        if not forward_only:
            raise ValueError("the LoRA base-model reference is forward only")
        with adapters_disabled(self.policy.model), torch.no_grad():
            return self.policy.forward_backward_batch(data, loss_fn, forward_only=True)

    def optimizer_step(self) -> float:
        raise RuntimeError("the LoRA base-model reference has no optimizer")

    def lr_scheduler_step(self) -> float:
        raise RuntimeError("the LoRA base-model reference has no optimizer")

    def get_per_tensor_param(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.policy.model.named_parameters():
            if not is_adapter_name(name):
                full = _full(param)
                yield name, (full.to(dtype) if dtype is not None else full)

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """The policy's weights move with the policy engine."""

    def save_checkpoint(self, path: str | Path) -> None:
        """Nothing of its own to save: the base weights are model.path's."""

    def load_checkpoint(self, path: str | Path) -> None:
        """Nothing of its own to load."""

    @property
    def dp_rank(self) -> int:
        return self.policy.dp_rank

    @property
    def dp_size(self) -> int:
        return self.policy.dp_size

    @property
    def dp_group(self):  # noqa: ANN201
        return self.policy.dp_group

    @property
    def device(self) -> torch.device:
        return self.policy.device
