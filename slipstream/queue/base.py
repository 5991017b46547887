"""What the other roles see of the queue: a producer side and a consumer side (design.md §3).

The rollouter only puts groups and takes back the ones the trainer dropped; the trainer only leases, acks,
nacks, and saves or restores what the queue holds alongside its checkpoints. Each side is a small ABC here,
so the trainer, the rollouter, wrappers around a client (the pipeline's lease tracker) and the tests' fakes
are typed against what they actually use, and a stand-in that lacks a method fails when it is built instead
of when the first call reaches the missing attribute.

Implementations: :class:`~slipstream.queue.client.AsyncQueueClient` is a :class:`QueueProducer` (the
rollouter's event loop awaits it), :class:`~slipstream.queue.client.QueueClient` a :class:`QueueConsumer`
(the trainer's rank 0 blocks on it). Both clients have every method; these are the subsets each role needs.

Worked example (the trainer's side of one step)::

    def step(queue: QueueConsumer) -> None:
        lease = queue.lease(8, timeout_s=30, consumer_version=version)   # None on timeout
        if lease is None:
            return
        try:
            train(collate(lease.groups))
        except BaseException:
            queue.nack(lease)                                            # the groups go back, first
            raise
        queue.ack(lease, dropped=too_stale_ids)                          # consumed for good
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations: this module stays importable without torch (the pipeline's driver)
    from slipstream.queue.types import GroupMeta, TrajectoryGroup


@dataclass
class Lease:
    """Groups handed to one consumer until it acks (consumed) or nacks (returned) them, or ``deadline``
    (``time.time()`` seconds) passes, after which the server returns them to the ready set.

    Tensors of groups that came through shared memory are views of the server's arena: they are valid until
    the lease is acked, nacked or expired, and must be copied to be kept (``collate`` copies).
    """

    lease_id: str
    groups: list[TrajectoryGroup]
    deadline: float


class QueueProducer(ABC):
    """The producer's side (the rollouter's): asynchronous, many coroutines may call it at once."""

    @abstractmethod
    async def put(
        self, group: TrajectoryGroup, *, partition: str = "train", timeout_s: float | None = None
    ) -> bool:
        """Store a whole group; False (nothing stored) when its group id or any uid was seen before. Waits up
        to ``timeout_s`` (None: the server's ``put_timeout_s``) for room, then raises ``QueueFull``."""

    @abstractmethod
    async def pop_dropped(self, max_groups: int = 1024) -> list[GroupMeta]:
        """Take (at most ``max_groups``) groups the consumer acked as dropped, so their prompts run again."""


class QueueConsumer(ABC):
    """The consumer's side (the trainer's rank 0): blocking calls, one at a time."""

    @abstractmethod
    def lease(
        self,
        n_groups: int,
        *,
        partition: str = "train",
        timeout_s: float | None = None,
        min_groups: int | None = None,
        consumer_version: int | None = None,
    ) -> Lease | None:
        """Up to ``n_groups`` groups in put order, once ``min_groups`` (default ``n_groups``) are ready;
        None when ``timeout_s`` passes first. ``consumer_version`` feeds the staleness statistics."""

    @abstractmethod
    def ack(self, lease: Lease | str, *, dropped: Sequence[str] = ()) -> None:
        """Consume the lease's groups for good; the ``dropped`` group ids were not trained (see
        :meth:`QueueProducer.pop_dropped`)."""

    @abstractmethod
    def nack(self, lease: Lease | str) -> None:
        """Give the lease's groups back to the front of the ready set now."""

    @abstractmethod
    def snapshot(self, name: str) -> dict:
        """Save everything unconsumed or leased as snapshot ``name`` (a name in the server's
        ``queue.snapshot_dir``, never a path); returns a summary."""

    @abstractmethod
    def restore(self, name: str) -> dict:
        """Bring snapshot ``name`` back into the queue (see :mod:`slipstream.queue.recovery`); returns a
        summary."""
