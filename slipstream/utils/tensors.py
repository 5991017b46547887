"""dtype names and tensor byte sizes, written once for every role.

Dtypes travel and appear in configs as torch's attribute names (``"bfloat16"``, ``"float8_e4m3fn"``): the
queue's wire specs, weight-sync bucket metadata, ``model.dtype``, ``weightsync.push_dtype``. Everything that
turns such a name into a ``torch.dtype`` (or back), or counts the bytes of a tensor, calls this module.

Worked example::

    parse_dtype("bfloat16")                   # torch.bfloat16
    parse_dtype("bf16")                       # torch.bfloat16 (the servers' spellings are accepted too)
    dtype_name(torch.float8_e4m3fn)           # "float8_e4m3fn"
    dtype_bytes("float32")                    # 4
    shape_nbytes([1024, 4096], torch.bfloat16)  # 8388608
    total_nbytes(model.parameters())          # bytes the parameters hold
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# Spellings the inference servers accept for --dtype, mapped to torch's names.
DTYPE_ALIASES: dict[str, str] = {"half": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's attribute name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, key: str = "") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"torch.float8_e4m3fn"``, ``"bf16"``).

    Raises ValueError naming ``key`` (the config key or field it came from) when given.
    """
    text = str(name).removeprefix("torch.")
    value = getattr(torch, DTYPE_ALIASES.get(text, text), None)
    if not isinstance(value, torch.dtype):
        where = f"{key}: " if key else ""
        raise ValueError(f"{where}unknown dtype `{name}` (expected a torch dtype name such as `bfloat16`)")
    return value


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or its name)."""
    return (parse_dtype(dtype) if isinstance(dtype, str) else dtype).itemsize


def shape_nbytes(shape: Iterable[int], dtype: torch.dtype | str) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``; ValueError for a negative dimension."""
    dims = list(shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return math.prod(dims) * dtype_bytes(dtype)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of the storage it may be a view of)."""
    return tensor.numel() * tensor.element_size()


def total_nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of all ``tensors`` together (``None`` entries count nothing)."""
    return sum(nbytes(t) for t in tensors if t is not None)


__all__ = [
    "DTYPE_ALIASES",
    "dtype_bytes",
    "dtype_name",
    "nbytes",
    "parse_dtype",
    "shape_nbytes",
    "total_nbytes",
]
