"""The upstream releases Slipstream is written against: one table, read by the contract checker, the
docs (``docs/contracts.md``, checked by a test) and the ``pyproject.toml`` extras (checked by a test).
The inference servers' rows take their release from the server's description (``slipstream.serverapi``),
which is where a vLLM or SGLang version is changed.

Each pin names the distribution on the package registry, its exact version, and the top-level
packages of its wheel whose Python sources the checker reads. ``nixl`` on the registry is a small
meta package that picks a CUDA-specific build at import time; its Python API lives in the build
(``nixl_cu12``), which is pinned to the same version.

Wheels are fetched for one reference platform (:data:`WHEEL_TARGET`: CPython 3.11 on x86-64 Linux,
where the servers run), whatever machine runs the check, so every machine reads the same files.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.serverapi import SGLANG, VLLM


@dataclass(frozen=True)
class Pin:
    dist: str  # the name on the package registry
    version: str
    packages: tuple[str, ...]  # top-level packages of the wheel that are kept in the cache
    extra: str  # the pyproject extra that installs it

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def key(self) -> str:
        return f"{self.dist}-{self.version}"


PINS: dict[str, Pin] = {
    "vllm": Pin(VLLM.dist, VLLM.version, ("vllm",), extra="vllm"),
    "sglang": Pin(SGLANG.dist, SGLANG.version, ("sglang",), extra="sglang"),
    "nixl": Pin("nixl", "1.5.1", ("nixl",), extra="nixl"),
    "nixl-cu12": Pin("nixl-cu12", "1.5.1", ("nixl_cu12",), extra="nixl"),
    "megatron-core": Pin("megatron-core", "0.16.1", ("megatron",), extra="megatron"),
}

# pip download options that select the reference platform's wheels (see the module docstring).
WHEEL_TARGET: tuple[str, ...] = (
    "--python-version", "3.11", "--implementation", "cp",
    "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_24_x86_64",
)  # fmt: skip
