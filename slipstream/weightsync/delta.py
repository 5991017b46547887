"""Send less: what a weight push needs to carry when most of the model did not change.

Pure functions on tensors, no transport: the engines (``torch_dist``, ``ipc``, ``nixl``) frame what these
return. Two halves.

**Delta pushes of full weights.** With RL learning rates an Adam step moves a weight by about ``lr``,
far below one ulp of its bf16 value (|w| ~ 0.02 has a bf16 ulp of 1.2e-4), so the *serving-dtype* copy of
most weights is bit-identical from one version to the next even though the fp32 master weights all
moved. :func:`compute_delta` compares the previous and the new serving-dtype tensors bit by bit (integer
views: ``-0.0`` and ``0.0`` differ, a NaN equals itself) and encodes the change in the smallest of

* ``sparse``: ascending flat ``indices`` (int32, or int64 past 2**31 elements) + the new ``values``;
* ``mask``: a packed bitmap of changed positions (1 bit per element, ``ceil(n / 8)`` bytes) + ``values``;
  smaller than ``sparse`` once more than 1 in 32 elements changed (an int32 index costs 4 bytes per
  changed element, the bitmap 1/8 byte per element);
* ``dense``: the whole new tensor, whenever the encodings above would not be smaller.

:func:`apply_delta` rebuilds the new tensor from the previous one by copying bits (no arithmetic), so the
receiver's tensor is bit-identical to a full push of the same version. Both ends must hold the same
previous version: that check (and a full push otherwise) belongs to the transport.

Example::

    d = compute_delta(prev_bf16, new_bf16)      # d.encoding in {"sparse", "mask", "dense"}; d.nbytes
    assert torch.equal(apply_delta(prev_bf16, d).view(torch.int16), new_bf16.view(torch.int16))

**LoRA adapters.** The trainer's LoRA layers (``trainer/engine/lora.py``) name their tensors as PEFT does
without the adapter name: ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r] beside
the base ``<module>.weight`` [out, in]. :func:`merge_lora` computes ``W + (alpha / r) B A`` in fp32 and casts
back to W's dtype; the trainer uses this same function when it pushes merged weights, so a receiver that
holds the same base tensor and applies the same adapter gets the same bits. :func:`to_peft_name` /
:func:`from_peft_name` map to the names vLLM and SGLang load adapters under (``base_model.model.`` + name),
and :func:`peft_adapter_config` writes the ``adapter_config.json`` fields they read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Encoding = Literal["sparse", "mask", "dense"]
ENCODINGS: tuple[Encoding, ...] = ("sparse", "mask", "dense")

# Bitwise comparison and copies go through same-width integer views.
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    **{
        getattr(torch, n): torch.int8
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    },
}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_INT32_MAX = 2**31 - 1


class DeltaError(ValueError):
    """A delta that does not fit the tensor it is applied to (shape, dtype or size)."""


class AdapterShapeError(ValueError):
    """LoRA tensors whose shapes do not match each other or the base weight they adapt."""


# ------------------------------------------------------------------------------------------ delta pushes
@dataclass(frozen=True)
class Delta:
    """The change from one version of a tensor to the next, in one of :data:`ENCODINGS`.

    ``values`` holds the new value of every changed element in flat order (``dense``: every element);
    ``indices`` (``sparse``) or ``mask`` (``mask``, packed little-endian bits) say where they go.
    """

    encoding: Encoding
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def changed(self) -> int:
        """Elements whose bits changed (``dense`` counts every element: it does not know)."""
        return int(self.values.numel())

    @property
    def nbytes(self) -> int:
        """Bytes this delta puts on the wire."""
        extra = self.indices if self.indices is not None else self.mask
        size = self.values.numel() * self.values.element_size()
        return size + (extra.numel() * extra.element_size() if extra is not None else 0)

    @property
    def dense_nbytes(self) -> int:
        return self.numel * self.values.element_size()


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a same-width integer tensor (floats), or ``t`` itself (integer and bool dtypes)."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def changed_mask(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ between ``prev`` and ``new`` (same shape and dtype)."""
    if prev.shape != new.shape or prev.dtype != new.dtype:
        raise DeltaError(
            f"delta between different tensors: {tuple(prev.shape)} {prev.dtype} vs "
            f"{tuple(new.shape)} {new.dtype}"
        )
    return bits_view(prev.reshape(-1)) != bits_view(new.reshape(-1))


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses ``numel`` elements."""
    return torch.int32 if numel <= _INT32_MAX else torch.int64


def encoded_nbytes(numel: int, changed: int, itemsize: int) -> dict[Encoding, int]:
    """Wire bytes of each encoding for ``changed`` of ``numel`` elements of ``itemsize`` bytes."""
    idx = torch.empty(0, dtype=index_dtype(numel)).element_size()
    return {
        "sparse": changed * (idx + itemsize),
        "mask": (numel + 7) // 8 + changed * itemsize,
        "dense": numel * itemsize,
    }


def choose_encoding(
    numel: int, changed: int, itemsize: int, allowed: Iterable[Encoding] = ENCODINGS
) -> Encoding:
    """The smallest allowed encoding; ``dense`` on a tie, and whenever it is allowed and not larger."""
    sizes = encoded_nbytes(numel, changed, itemsize)
    allowed = [e for e in ENCODINGS if e in set(allowed)]
    if not allowed:
        raise ValueError("choose_encoding: no encoding allowed")
    # dense first among equals: it needs no index work on either end
    order = sorted(allowed, key=lambda e: (sizes[e], e != "dense"))
    return order[0]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool mask -> uint8 bytes, element i at bit ``i % 8`` of byte ``i // 8`` (zero padded)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = _BIT_WEIGHTS.to(flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a flat bool mask."""
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 7) // 8:
        raise DeltaError(f"bit mask of {packed.numel()} {packed.dtype} bytes cannot hold {numel} elements")
    weights = _BIT_WEIGHTS.to(packed.device)
    return (packed[:, None] & weights).ne(0).reshape(-1)[:numel]


def compute_delta(prev: torch.Tensor, new: torch.Tensor, allowed: Iterable[Encoding] = ENCODINGS) -> Delta:
    """The change from ``prev`` to ``new`` (same shape and dtype) in its smallest allowed encoding."""
    changed = changed_mask(prev, new)
    n_changed = int(changed.sum())
    flat_new = new.reshape(-1)
    encoding = choose_encoding(flat_new.numel(), n_changed, new.element_size(), allowed)
    shape = tuple(new.shape)
    if encoding == "dense":
        return Delta("dense", shape, new.dtype, flat_new.clone())
    values = bits_view(flat_new)[changed].view(new.dtype)  # through bits: fp8 has no boolean indexing
    if encoding == "mask":
        return Delta("mask", shape, new.dtype, values, mask=pack_bits(changed))
    indices = changed.nonzero()[:, 0].to(index_dtype(flat_new.numel()))
    return Delta("sparse", shape, new.dtype, values, indices=indices)


def apply_delta_(target: torch.Tensor, delta: Delta) -> torch.Tensor:
    """Write ``delta`` into ``target`` (the previous version, contiguous) in place; return ``target``.

    Bits are copied, never computed, so the result equals the new version bit for bit.
    """
    if tuple(target.shape) != delta.shape or target.dtype != delta.dtype:
        raise DeltaError(
            f"delta for {delta.shape} {delta.dtype} applied to {tuple(target.shape)} {target.dtype}"
        )
    if not target.is_contiguous():
        raise DeltaError("apply_delta_: the target must be contiguous (its flat view is written)")
    flat = bits_view(target.view(-1))
    values = bits_view(delta.values.reshape(-1)).to(flat.device)
    if delta.encoding == "dense":
        if values.numel() != flat.numel():
            raise DeltaError(f"dense delta of {values.numel()} elements for {flat.numel()}")
        flat.copy_(values)
        return target
    if delta.encoding == "mask":
        where = unpack_bits(delta.mask.to(flat.device), flat.numel())
        if int(where.sum()) != values.numel():
            raise DeltaError(f"mask marks {int(where.sum())} elements, {values.numel()} values sent")
        flat[where] = values
        return target
    if delta.encoding == "sparse":
        idx = delta.indices.to(device=flat.device, dtype=torch.int64)
        if idx.numel() != values.numel():
            raise DeltaError(f"{idx.numel()} indices for {values.numel()} values")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= flat.numel()):
            raise DeltaError(f"delta index out of range for {flat.numel()} elements")
        flat.index_copy_(0, idx, values)
        return target
    raise DeltaError(f"unknown delta encoding {delta.encoding!r}")


def apply_delta(prev: torch.Tensor, delta: Delta) -> torch.Tensor:
    """The new version rebuilt from ``prev`` (left untouched) and ``delta``."""
    return apply_delta_(prev.contiguous().clone(), delta)


# ------------------------------------------------------------------------------------------ LoRA adapters
LORA_A, LORA_B = "lora_A", "lora_B"
PEFT_PREFIX = "base_model.model."


def adapter_name(module: str, which: Literal["A", "B"]) -> str:
    """Name of the A or B tensor of the LoRA layer on module ``module`` (``model.layers.0.mlp.up_proj``)."""
    return f"{module}.{LORA_A if which == 'A' else LORA_B}.weight"


def is_adapter_name(name: str) -> bool:
    return name.endswith((f".{LORA_A}.weight", f".{LORA_B}.weight"))


def adapter_target(name: str) -> tuple[str, Literal["A", "B"]]:
    """(name of the base weight it adapts, "A" or "B") of an adapter tensor name."""
    for part, which in ((LORA_A, "A"), (LORA_B, "B")):
        suffix = f".{part}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", which
    raise ValueError(f"{name!r} is not a LoRA adapter tensor name (<module>.lora_A/B.weight)")


def to_peft_name(name: str) -> str:
    """Our adapter tensor name -> the PEFT checkpoint name vLLM and SGLang load."""
    adapter_target(name)  # validates
    return PEFT_PREFIX + name


def from_peft_name(name: str) -> str:
    """A PEFT adapter tensor name (``base_model.model.<module>.lora_A[.default].weight``) -> ours."""
    if not name.startswith(PEFT_PREFIX):
        raise ValueError(f"{name!r} is not a PEFT adapter name (no {PEFT_PREFIX!r} prefix)")
    name = name[len(PEFT_PREFIX) :]
    for part in (LORA_A, LORA_B):
        name = name.replace(f".{part}.default.weight", f".{part}.weight")
    adapter_target(name)
    return name


def adapter_shapes(
    base_shapes: Iterable[tuple[str, tuple[int, ...]]], rank: int, target_modules: Iterable[str]
) -> list[tuple[str, tuple[int, ...]]]:
    """(adapter tensor name, shape) of every LoRA tensor a rank-``rank`` adapter on ``target_modules`` has
    for a base model with these (name, shape) parameters: A [r, in] then B [out, r] per adapted 2-D weight
    whose module's last name part is a target. What a receiver allocates, and checks an adapter against."""
    targets = set(target_modules)
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in base_shapes:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or module.rpartition(".")[2] not in targets:
            continue
        out.append((adapter_name(module, "A"), (rank, shape[1])))
        out.append((adapter_name(module, "B"), (shape[0], rank)))
    return out


def lora_scale(alpha: float, rank: int) -> float:
    """The factor LoRA's update is scaled by: alpha / r."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    return float(alpha) / float(rank)


def check_adapter_shapes(
    weight_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...], name: str = "weight"
) -> None:
    """Raise :class:`AdapterShapeError` unless A is [r, in] and B is [out, r] for a W of [out, in]."""
    ok = (
        len(weight_shape) == 2
        and len(a_shape) == 2
        and len(b_shape) == 2
        and a_shape[1] == weight_shape[1]
        and b_shape[0] == weight_shape[0]
        and a_shape[0] == b_shape[1]
    )
    if not ok:
        raise AdapterShapeError(
            f"{name}: LoRA A {tuple(a_shape)} and B {tuple(b_shape)} do not fit the base weight "
            f"{tuple(weight_shape)} (need A [r, in], B [out, r] for W [out, in])"
        )


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A``, computed in fp32 and returned in W's dtype (a new tensor).

    One fused ``addmm`` so that every caller (the trainer's merged push, a receiver merging an adapter into
    its base) gets the same bits from the same inputs on the same kind of device.
    """
    check_adapter_shapes(tuple(weight.shape), tuple(a.shape), tuple(b.shape))
    w32 = weight.to(torch.float32)
    b32 = b.to(device=w32.device, dtype=torch.float32)
    merged = torch.addmm(w32, b32, a.to(device=w32.device, dtype=torch.float32), alpha=float(scale))
    return merged.to(weight.dtype)


def pair_adapters(adapters: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} from named adapter tensors; a missing half is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        base, which = adapter_target(name)
        halves.setdefault(base, {})[which] = tensor
    pairs = {}
    for base, h in halves.items():
        if set(h) != {"A", "B"}:
            missing = "B" if "A" in h else "A"
            raise AdapterShapeError(f"{base}: LoRA {missing} tensor missing")
        pairs[base] = (h["A"], h["B"])
    return pairs


def merge_adapters(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Merged weights {base weight name: W + scale B A} of every base weight the adapters adapt.

    Raises :class:`AdapterShapeError` for an adapter whose base weight is absent or whose shapes do not
    fit it, before anything is merged.
    """
    pairs = pair_adapters(adapters)
    for name, (a, b) in pairs.items():
        if name not in base:
            raise AdapterShapeError(f"LoRA adapter for {name}, which the base model does not have")
        check_adapter_shapes(tuple(base[name].shape), tuple(a.shape), tuple(b.shape), name)
    return {name: merge_lora(base[name], a, b, scale) for name, (a, b) in pairs.items()}


def peft_adapter_config(
    rank: int, alpha: float, target_modules: Iterable[str], dropout: float = 0.0, base_model: str = ""
) -> dict:
    """The ``adapter_config.json`` fields PEFT, vLLM and SGLang read for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
