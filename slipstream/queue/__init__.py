"""TransferQueue: producers put whole groups, consumers lease and ack them (design.md §3).

The public names are importable from here; they load on first use, so ``import slipstream.queue.types``
stays cheap for processes that only need the data types. The roles that use the queue are typed against
:class:`QueueProducer` (the rollouter) and :class:`QueueConsumer` (the trainer), in :mod:`slipstream.queue.base`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "QueueClient": "slipstream.queue.client",
    "AsyncQueueClient": "slipstream.queue.client",
    "Lease": "slipstream.queue.base",
    "QueueConsumer": "slipstream.queue.base",
    "QueueProducer": "slipstream.queue.base",
    "QueueError": "slipstream.queue.client",
    "QueueFull": "slipstream.queue.client",
    "QueueStats": "slipstream.queue.protocol",
    "PartitionStats": "slipstream.queue.protocol",
    "QueueConfig": "slipstream.queue.config",
    "QueueServer": "slipstream.queue.server",
    "QueueServerActor": "slipstream.queue.server",
    "QueueServerHandle": "slipstream.queue.server",
    "start_queue_server": "slipstream.queue.server",
    "collate": "slipstream.queue.batch",
    "Trajectory": "slipstream.queue.types",
    "TrajectoryGroup": "slipstream.queue.types",
    "GroupMeta": "slipstream.queue.types",
    "SampleMeta": "slipstream.queue.types",
    "Provenance": "slipstream.queue.types",
    "SampleOutcome": "slipstream.queue.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.queue' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
