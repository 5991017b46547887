"""What a queue server holds: the records of groups, leases and parked requests, and the :class:`Ledger`.

The controller (:mod:`~slipstream.queue.controller`) is the one state machine of a server; it owns a ledger
and hands it to its lease table (:mod:`~slipstream.queue.leases`) and its recovery
(:mod:`~slipstream.queue.recovery`), which change the queue only through the ledger's methods. So the
invariants about what is held and what was consumed are kept in one place, whoever moves a group.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream.queue import protocol as P
from slipstream.queue.codec import WireError
from slipstream.queue.stats import PartitionCounters
from slipstream.queue.storage import StorageUnit
from slipstream.queue.types import GroupMeta

READY, LEASED = 1, 2

ReplyTo = Any  # (socket, identity) as the server loop gives it
Send = Callable[..., bool]  # send(reply_to, msg_type, header, buffers=()) -> False if the requester is gone
Clock = Callable[[], float]  # monotonic seconds: time.monotonic, or a test's hand-driven clock

_PARTITION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


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
    ready: deque[str] = field(default_factory=deque)  # group ids in put order
    counters: PartitionCounters = field(default_factory=PartitionCounters)


class Ledger:
    """The groups one server holds (READY or LEASED) and what it has consumed; not thread-safe.

    Invariants it keeps:
      * a group id or uid is accepted at most once: :meth:`is_seen` covers held groups and everything ever
        consumed (acked or quarantined), so a replayed put is refused and nothing is trained twice;
      * each partition's ready set is in put order (``seq``), also after groups come back to it;
      * ``held_groups``/``held_bytes`` count exactly the held groups, whose storage (arena region or blobs in
        their unit) is freed when they are released.

    The lease table, the recovery and the statistics read its collections; the held groups, the ready sets
    and the consumed ids change only through the methods here (a partition's counters are bumped by whoever
    counts, and a group's lease fields belong to the lease table).

    Worked example::

        ledger = Ledger(units)
        group = ledger.new_group("train", meta, specs, nbytes, unit=0, token=next(ledger.tokens))
        ledger.hold(group); ledger.make_ready(group)       # ready, first in line
        ... leased, then acked ...
        ledger.consume(group, dropped=False)               # storage freed; its ids are never admitted again
    """

    def __init__(self, units: Sequence[StorageUnit]) -> None:
        self.units = list(units)
        self.tokens: Iterator[int] = itertools.count(1)  # storage tokens, shared with the arena credits
        self._seq = itertools.count()
        self.groups: dict[str, Group] = {}
        self.by_token: dict[int, Group] = {}
        self.partitions: dict[str, Partition] = {}
        self._held_uids: set[str] = set()
        self.consumed_groups: set[str] = set()
        self.consumed_uids: set[str] = set()
        self.dropped: deque[GroupMeta] = deque()  # acked as dropped, until a producer pops them
        self.held_groups = 0
        self.held_bytes = 0

    # ---------------------------------------------------------------------------------------- lookups
    def part(self, name: str) -> Partition:
        """The partition ``name`` (created on first use; a bad name is a bad_request)."""
        part = self.partitions.get(name)
        if part is None:
            if not _PARTITION_RE.match(name):
                raise WireError("bad_request", f"partition {name!r}: use 1-64 letters, digits, '_', '-', '.'")
            part = self.partitions[name] = Partition()
        return part

    def is_seen(self, meta: GroupMeta) -> bool:
        gid = meta.group_id
        if gid in self.groups or gid in self.consumed_groups:
            return True
        return any(s.uid in self._held_uids or s.uid in self.consumed_uids for s in meta.samples)

    def in_put_order(self) -> list[Group]:
        return sorted(self.groups.values(), key=lambda g: g.seq)

    # ---------------------------------------------------------------------------------- holding
    def new_group(
        self,
        partition: str,
        meta: GroupMeta,
        specs: list[P.TensorSpec],
        nbytes: int,
        unit: int,
        token: int,
        seq: int | None = None,
    ) -> Group:
        """A group record, last in put order unless ``seq`` places it (a restore puts groups in front)."""
        return Group(next(self._seq) if seq is None else seq, partition, meta, specs, nbytes, unit, token)

    def hold(self, group: Group) -> None:
        self.groups[group.meta.group_id] = group
        self.by_token[group.token] = group
        self._held_uids.update(s.uid for s in group.meta.samples)
        self.held_groups += 1
        self.held_bytes += group.nbytes

    def hold_restored(
        self,
        partition: str,
        meta: GroupMeta,
        specs: list[P.TensorSpec],
        nbytes: int,
        unit: int,
        seq: int,
        buffers: Sequence[Any],
        arena_offset: int = -1,
        region_bytes: int = 0,
    ) -> None:
        """Hold a group a restore brings back: in an arena region, or with ``buffers`` in its unit's blob
        store. It joins the ready set when the caller merges it in (:meth:`return_to_ready`)."""
        self.part(partition)
        group = self.new_group(partition, meta, specs, nbytes, unit, next(self.tokens), seq)
        if arena_offset >= 0:
            group.arena_offset, group.region_bytes, group.num_buffers = arena_offset, region_bytes, 1
        else:
            self.units[unit].store(group.token, list(buffers))
            group.num_buffers = len(buffers)
        self.hold(group)

    def release(self, group: Group) -> None:
        """Forget a held group and free its storage."""
        del self.groups[group.meta.group_id]
        del self.by_token[group.token]
        self._held_uids.difference_update(s.uid for s in group.meta.samples)
        self.held_groups -= 1
        self.held_bytes -= group.nbytes
        unit = self.units[group.unit]
        if group.arena_offset >= 0:
            unit.arena.free(group.arena_offset)
        else:
            unit.drop(group.token)

    def consume(self, group: Group, dropped: bool) -> None:
        """An acked group: released, and its ids never admitted again; a dropped one waits for
        :meth:`pop_dropped` (its producer generates the prompt again)."""
        self._forget(group)
        self.part(group.partition).counters.on_ack(dropped)
        if dropped:
            self.dropped.append(group.meta)

    def quarantine(self, group: Group) -> None:
        """A group its consumer could not unpack: released for good, as if consumed."""
        self._forget(group)
        self.part(group.partition).counters.quarantined_total += 1

    def _forget(self, group: Group) -> None:
        self.release(group)
        self.consumed_groups.add(group.meta.group_id)
        self.consumed_uids.update(s.uid for s in group.meta.samples)

    def set_consumed(self, groups: set[str], uids: set[str]) -> None:
        """Replace what counts as consumed (a rollback to a snapshot)."""
        self.consumed_groups, self.consumed_uids = groups, uids

    def merge_consumed(
        self, groups: Iterable[str], uids: Iterable[str], dropped: Iterable[GroupMeta]
    ) -> None:
        """Add a snapshot's consumed ids and the dropped groups not listed yet (a merge)."""
        self.consumed_groups.update(groups)
        self.consumed_uids.update(uids)
        known = {m.group_id for m in self.dropped}
        self.dropped.extend(m for m in dropped if m.group_id not in known)

    def undrop(self, group_ids: set[str]) -> None:
        """Forget the dropped entries of groups that are ready again (a rollback)."""
        if group_ids:
            self.dropped = deque(m for m in self.dropped if m.group_id not in group_ids)

    def pop_dropped(self, max_groups: int) -> list[GroupMeta]:
        n = max(0, min(max_groups, len(self.dropped)))
        return [self.dropped.popleft() for _ in range(n)]

    # ---------------------------------------------------------------------------------- ready sets
    def make_ready(self, group: Group) -> Partition:
        """A newly put group joins the end of its partition's ready set; returns the partition."""
        group.state = READY
        part = self.part(group.partition)
        part.ready.append(group.meta.group_id)
        part.counters.on_put(group.nbytes)
        return part

    def front(self, part: Partition, n: int) -> list[Group]:
        """The first ``n`` (or fewer) groups of the ready set, left in it."""
        return [self.groups[gid] for gid in itertools.islice(part.ready, n)]

    def take_front(self, part: Partition, n: int) -> None:
        """Take the first ``n`` groups out of the ready set (they are being leased)."""
        for _ in range(n):
            part.ready.popleft()

    def take_ready(self, group: Group) -> None:
        """Take one ready group out of its ready set (a late ack consumes it)."""
        self.part(group.partition).ready.remove(group.meta.group_id)

    def return_to_ready(self, part: Partition, group_ids: list[str]) -> None:
        """Held groups (back from a lease, or restored) join the ready set in put order."""
        groups = sorted((self.groups[gid] for gid in group_ids), key=lambda g: g.seq)
        for g in groups:
            g.state = READY  # lease_id stays: the fence a late ack of that lease is checked against
        ids = [g.meta.group_id for g in groups]
        if not part.ready or groups[-1].seq < self.groups[part.ready[0]].seq:
            part.ready.extendleft(reversed(ids))
        else:
            part.ready = deque(heapq.merge(ids, part.ready, key=lambda gid: self.groups[gid].seq))
