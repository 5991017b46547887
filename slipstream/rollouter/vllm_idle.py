"""How long vLLM's processes spin while they wait for each other, set from ``SLIPSTREAM_VLLM_SPIN_S``.

vLLM's engine process and its worker process hand each model step over through a shared-memory queue whose
reader, after any read, busy-waits (``sched_yield`` in a loop) for a second before it sleeps on a socket
(``SpinCondition.busy_loop_s``, 1 s in vLLM 0.32, not configurable). On a GPU machine that costs a spare CPU
core. On a CPU machine the engine process waits on the worker for every step, so it spins for as long as the
worker computes, on a core the worker's threads or the trainer's need: on the 2-core machine, with one
vLLM thread and one trainer thread, vLLM's engine process took 70-75% of a core doing nothing
(``docs/benchmarks.md``, "Quickstart"). The launcher sets ``SLIPSTREAM_VLLM_SPIN_S=0`` for vLLM's CPU build,
and this package's ``vllm.general_plugins`` entry point (``vllm_weights.register``), which vLLM runs in each
of its processes before it builds any queue, applies it: the reader then waits on the socket at once (its
notification costs tens of microseconds against a step of tens of milliseconds).

Why patch rather than configure: vLLM has no setting for it; the patch is one default of one pinned class,
checked by ``tests/vllm`` (the server runs with it) and by ``test_vllm_idle.py`` (the class still has it).
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
