"""What this machine's CPU offers that decides how Slipstream runs on it: its cores and native bf16.

Read from ``/proc/cpuinfo`` (Linux, where servers and trainers run) and the process's CPU affinity; on any
other system the answers are the conservative ones (no native bf16; ``os.cpu_count()`` cores).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

# The flags with which a CPU computes bf16 matrix products natively: AVX512-BF16 or AMX on x86 (Cooper Lake,
# Sapphire Rapids and later; Zen 4), BF16 on Arm (Armv8.6). Without them, a bf16 matmul is emulated by
# converting to fp32, and vLLM's CPU build decodes 4.5x slower in bf16 than in fp32 (docs/benchmarks.md).
BF16_FLAGS = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on Arm); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU (or one with ``flags`` on ``machine``) computes bf16 natively (:data:`BF16_FLAGS`)."""
    flags = cpu_flags() if flags is None else flags
    wanted = BF16_FLAGS.get(machine or platform.machine(), ())
    return any(flag in flags for flag in wanted)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or ``taskset`` narrows)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
