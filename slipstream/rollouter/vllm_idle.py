"""How long vLLM's processes spin while they wait for each other, set from ``SLIPSTREAM_VLLM_SPIN_S`` (opt-in).

vLLM's engine process and its worker process hand each model step over through a shared-memory queue whose
reader, after any read, busy-waits (``sched_yield`` in a loop) for a second before it sleeps on a socket
(``SpinCondition.busy_loop_s``, 1 s in vLLM 0.32, not configurable). On a CPU the engine process therefore
spins through every model step of its worker, on a core the worker's OpenMP threads or a trainer may need:
with two OpenMP threads on the 2-core machine, vLLM made 317 tokens/s spinning and 415 without
(``slipstream bench served-dtype --cpu-threads 2 --dtypes bfloat16 --spin 0``; ``docs/benchmarks.md``,
"Served dtype").

It is not the launcher's default, because vLLM's sleeping reader can miss its wake-up: the writer's
notification socket drops messages at a high-water mark of one, and a reader that missed one rechecks only
every 5 s (``SHM_READER_RECHECK_INTERVAL_MS``). Without spinning, the engine's idle moments (a paused server
switching weights) then stall for those 5 s: the quickstart's pushes kept vLLM paused 10.4 s each instead of
0.48 s. A user who runs vLLM with several OpenMP threads and no weight pushes can set it in the server's
environment (``SLIPSTREAM_VLLM_SPIN_S=0``); this package's ``vllm.general_plugins`` entry point
(``vllm_weights.register``), which vLLM runs in each of its processes, applies it.
"""

from __future__ import annotations

import os

from slipstream.utils.logging import get_logger

log = get_logger(__name__)

SPIN_ENV = "SLIPSTREAM_VLLM_SPIN_S"


def apply_spin_setting() -> None:
    """Make vLLM's shared-memory readers spin ``$SLIPSTREAM_VLLM_SPIN_S`` seconds (unset: vLLM's own)."""
    value = os.environ.get(SPIN_ENV, "").strip()
    if not value:
        return
    spin_s = float(value)
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_slipstream_spin_s", None) == spin_s:
        return
    original = getattr(condition, "_slipstream_original_init", condition.__init__)

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = spin_s

    condition._slipstream_original_init = original
    condition.__init__ = __init__
    condition._slipstream_spin_s = spin_s
    log.debug("vLLM's shared-memory readers spin %.3f s before they sleep", spin_s)


__all__ = ["SPIN_ENV", "apply_spin_setting"]
