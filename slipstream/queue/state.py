"""The controller's records of groups, leases, parked requests and partitions (shared by its handler modules).

Kept apart from the handlers so that :mod:`~slipstream.queue.controller`, :mod:`~slipstream.queue.leases` and
:mod:`~slipstream.queue.recovery` each stay about one thing while working on the same state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.queue import protocol as P
from slipstream.queue.stats import PartitionCounters
from slipstream.queue.types import GroupMeta

READY, LEASED = 1, 2

ReplyTo = Any  # (socket, identity) as the server loop gives it
Send = Callable[..., bool]  # send(reply_to, msg_type, header, buffers=()) -> False if the requester is gone


@dataclass(slots=True, eq=False)
class Group:
    seq: int
    partition: str
    meta: GroupMeta
    specs: list[P.TensorSpec]
    nbytes: int
    unit: int
    token: int
    arena_offset: int = -1  # -1: buffers live in the unit's blob store
    region_bytes: int = 0  # bytes of the arena region its tensors span
    num_buffers: int = 0
    state: int = READY
    lease_id: str = ""


@dataclass(slots=True, eq=False)
class LeaseRecord:
    lease_id: str
    partition: str
    group_ids: list[str]
    deadline: float
    owner: bytes = b""  # the secret of the client it was granted to


@dataclass(slots=True, eq=False)
class Waiter:
    """A parked request: a lease waiting for groups or a put waiting for room."""

    reply_to: ReplyTo
    req: Any
    deadline: float
    nbytes: int = 0
    on_admit: Callable[[], None] | None = None
    on_duplicate: Callable[[], None] | None = None
    on_timeout: Callable[[], None] | None = None
    done: bool = False
    # Payload bytes the parked request holds in server memory (a socket put's frames; 0 for the rest).
    frame_bytes: int = 0

    @property
    def is_put(self) -> bool:
        return self.on_admit is not None


@dataclass(slots=True)
class Partition:
    ready: deque[str] = field(default_factory=deque)
    waiters: deque[Waiter] = field(default_factory=deque)
    counters: PartitionCounters = field(default_factory=PartitionCounters)
