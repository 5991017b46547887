"""transformers' FIFO scheduler, with cancellation lifting the "cache full" admission block.

When the paged KV cache fills, transformers' ``OffloadingManager.offload_requests`` evicts some running
requests back to the waiting queue and sets ``scheduler.block_new_requests``: while it is set, no waiting
request (new or evicted) is scheduled. Only ``ContinuousBatchProcessor.update_batch`` clears it, when a
running request *finishes*. A cancelled request frees its cache just the same, but
``Scheduler.clear_cancelled_requests`` leaves the flag alone, so cancelling every running request (a pause
in ``abort`` mode, or every client disconnecting) left the flag set with nothing running that could ever
finish: the server never admitted a request again.

:class:`CancelAwareFIFOScheduler` lifts the block whenever a cancellation frees the cache of a running
request, as a finish does, and whenever nothing is left running. Both run on the generation thread, inside
``prepare_next_batch`` and before ``schedule_batch``, so the next batch already sees the freed cache.

transformers picks the scheduler class by name from ``SCHEDULER_MAPPING`` (``ContinuousBatchingConfig.
scheduler_type``); :func:`install` registers this one under :data:`SCHEDULER_TYPE`.
"""

from __future__ import annotations

from transformers.generation.continuous_batching.requests import RequestState
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

SCHEDULER_TYPE = "slipstream-fifo"


class CancelAwareFIFOScheduler(FIFOScheduler):
    """FIFO scheduling; a cancelled running request lifts ``block_new_requests`` as a finished one does.

    Invariant kept: ``block_new_requests`` is never set while ``active_requests`` is empty (only an active
    request finishing could clear it then, and there is none).
    """

    def clear_cancelled_requests(self) -> list[RequestState]:
        with self._cancellation_lock:
            frees_running = any(rid in self.active_requests for rid in self._requests_to_cancel)
        cancelled = super().clear_cancelled_requests()
        if frees_running or not self.active_requests:
            self.block_new_requests = False
        return cancelled


def install() -> str:
    """Register the scheduler with transformers (idempotent); returns the ``scheduler_type`` to use."""
    SCHEDULER_MAPPING[SCHEDULER_TYPE] = CancelAwareFIFOScheduler
    return SCHEDULER_TYPE
