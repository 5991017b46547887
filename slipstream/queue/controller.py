"""The controller: the queue's metadata, leases, deduplication, back-pressure and statistics.

It never holds payload bytes. Payloads sit in the storage units (socket frames or an arena region); the
controller keeps, per group, where they are. Every handler runs on the server's one loop thread, returns
without waiting, and answers through ``send``; a request that has to wait (a lease for groups not yet put, a
put that meets a full queue) is *parked* with a deadline and answered the moment it can be, or with a
timeout when the deadline passes. So readiness is pushed to waiting clients, never polled or slept on, and
a waiting request of one kind never holds up another.

Lifecycle of a group (``seq`` is its put order; the ready set is always sorted by it)::

    put (socket frames) ─────────────────► READY ──lease──► LEASED ──ack──► consumed, journalled
    commit (into an arena credit) ───────┘   ▲  ▲             │                  │         │
                                             │  └nack/deadline┘    next snapshot │         │ restore of a
                                             │                     commits: gone ◄┘         │ known snapshot
                                             └──────────────────────────────────────────────┘ (rollback)

Acked groups go to the :mod:`~slipstream.queue.journal` (header and payload, copied out of shared memory)
until the next snapshot commits, so a trainer that crashes and restores its last snapshot on this live server
gets back what it acked since; snapshot and restore live in :mod:`slipstream.queue.recovery`.

Same-host producers write into arena *credits* (regions reserved for their next put, see
:mod:`slipstream.queue.credits`): a commit both admits the group written there and hands out the next credit,
so a shared-memory put is one round trip, like a socket put.

Invariants:
  * a group id or uid is accepted at most once: ``_is_seen`` covers held groups (ready, leased) and
    everything ever acked, so a replayed put is refused and nothing is trained twice;
  * a group is handed out only from READY and never after its ack; a lease whose deadline passed goes back
    to the ready set, and a late ack of it still consumes whatever of it was not handed out again;
  * ``held_groups``/``held_bytes`` count READY + LEASED groups; capacity bounds them plus the consumed
    groups whose journal copy is not written yet (their buffers are still held).
"""

from __future__ import annotations

import heapq
import itertools
import re
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from slipstream.queue import protocol as P
from slipstream.queue.background import Background
from slipstream.queue.codec import WireError, region_extent, validate_group
from slipstream.queue.config import QueueConfig
from slipstream.queue.credits import Credits
from slipstream.queue.journal import Journal
from slipstream.queue.recovery import Recovery
from slipstream.queue.stats import PartitionCounters
from slipstream.queue.storage import StorageUnit
from slipstream.queue.types import GroupMeta
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

READY, LEASED = 1, 2
_PARTITION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EXPIRED_LEASES_KEPT = 4096

ReplyTo = Any  # (socket, identity) as the server loop gives it
Send = Callable[..., bool]  # send(reply_to, msg_type, header, buffers=()) -> False if the requester is gone


@dataclass(slots=True, eq=False)
class _Group:
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
class _Lease:
    lease_id: str
    partition: str
    group_ids: list[str]
    deadline: float


@dataclass(slots=True, eq=False)
class _Waiter:
    """A parked request: a lease waiting for groups or a put waiting for room."""

    reply_to: ReplyTo
    req: Any
    deadline: float
    nbytes: int = 0
    on_admit: Callable[[], None] | None = None
    on_duplicate: Callable[[], None] | None = None
    on_timeout: Callable[[], None] | None = None
    done: bool = False


@dataclass(slots=True)
class _Partition:
    ready: deque[str] = field(default_factory=deque)
    waiters: deque[_Waiter] = field(default_factory=deque)
    counters: PartitionCounters = field(default_factory=PartitionCounters)


class Controller(Recovery):
    """Metadata owner of one queue server. Not thread-safe: only the server loop thread calls it."""

    def __init__(
        self, cfg: QueueConfig, units: Sequence[StorageUnit], send: Send, nonce: bytes, direct: str = ""
    ) -> None:
        self.cfg = cfg
        self._direct = direct
        self.units = list(units)
        self._send = send
        self._nonce = nonce
        self._lease_prefix = secrets.token_hex(4)
        self._started = time.monotonic()
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._groups: dict[str, _Group] = {}
        self._by_token: dict[int, _Group] = {}
        self._partitions: dict[str, _Partition] = {}
        # Leases have one fixed timeout, so insertion order is deadline order: expiry only looks at the
        # front (a heap of them would grow with every lease).
        self._leases: OrderedDict[str, _Lease] = OrderedDict()
        self.credits = Credits(self.units, self._tokens, cfg.reserve_timeout_s)
        self._expired: OrderedDict[str, list[str]] = OrderedDict()
        self._held_uids: set[str] = set()
        self._consumed_groups: set[str] = set()
        self._consumed_uids: set[str] = set()
        self._dropped: deque[GroupMeta] = deque()
        self._parked_puts: deque[_Waiter] = deque()
        self._timers: list[tuple[float, int, str, Any]] = []  # parked requests, each with its own timeout
        self._timer_seq = itertools.count()
        self._background = Background()
        self.journal = Journal(cfg.journal_dir) if cfg.journal else None
        self._commits: OrderedDict[str, tuple[frozenset[str], frozenset[str]]] = OrderedDict()
        self.held_groups = 0
        self.held_bytes = 0

    # -------------------------------------------------------------------------------------- helpers
    def _part(self, name: str) -> _Partition:
        part = self._partitions.get(name)
        if part is None:
            if not _PARTITION_RE.match(name):
                raise WireError("bad_request", f"partition {name!r}: use 1-64 letters, digits, '_', '-', '.'")
            part = self._partitions[name] = _Partition()
        return part

    def _timer(self, deadline: float, kind: str, key: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), kind, key))

    def _ok(self, reply_to: ReplyTo, header: msgspec.Struct, buffers: Sequence[Any] = ()) -> bool:
        return self._send(reply_to, P.MsgType.OK, header, buffers)

    def _is_seen(self, meta: GroupMeta) -> bool:
        gid = meta.group_id
        if gid in self._groups or gid in self._consumed_groups:
            return True
        return any(s.uid in self._held_uids or s.uid in self._consumed_uids for s in meta.samples)

    def _hold(self, group: _Group) -> None:
        self._groups[group.meta.group_id] = group
        self._by_token[group.token] = group
        self._held_uids.update(s.uid for s in group.meta.samples)
        self.held_groups += 1
        self.held_bytes += group.nbytes

    def _hold_restored(
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
        store. It joins the ready set when the caller merges it in (``_return_to_ready``)."""
        self._part(partition)
        token = next(self._tokens)
        group = _Group(seq, partition, meta, specs, nbytes, unit, token)
        if arena_offset >= 0:
            group.arena_offset, group.region_bytes, group.num_buffers = arena_offset, region_bytes, 1
        else:
            self.units[unit].store(token, list(buffers))
            group.num_buffers = len(buffers)
        self._hold(group)

    def _release(self, group: _Group) -> None:
        """Forget a group and free its storage (after its ack)."""
        del self._groups[group.meta.group_id]
        del self._by_token[group.token]
        self._held_uids.difference_update(s.uid for s in group.meta.samples)
        self.held_groups -= 1
        self.held_bytes -= group.nbytes
        unit = self.units[group.unit]
        if group.arena_offset >= 0:
            unit.arena.free(group.arena_offset)
        else:
            unit.drop(group.token)

    # ----------------------------------------------------------------------------------- admission
    def _admit(
        self,
        req: P.PutRequest | P.CommitRequest,
        nbytes: int,
        reply_to: ReplyTo,
        on_admit: Callable[[], None],
        on_duplicate: Callable[[], None],
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Run ``on_admit`` now or once capacity allows; ``on_duplicate`` when the group was seen; on a
        timeout, ``on_timeout`` then a QueueFull reply."""
        self._part(req.partition)
        if self._is_seen(req.meta):
            self._part(req.partition).counters.duplicates_total += 1
            on_duplicate()
            return
        if nbytes > self.cfg.capacity_bytes:
            raise WireError(
                "bad_request",
                f"group {req.meta.group_id!r} has {nbytes} bytes, more than capacity_bytes="
                f"{self.cfg.capacity_bytes}: it could never fit; raise queue.capacity_bytes",
            )
        while self._parked_puts and self._parked_puts[0].done:
            self._parked_puts.popleft()
        if not self._parked_puts and self._fits(nbytes):
            on_admit()
            return
        deadline = time.monotonic() + max(0.0, req.timeout_s)
        waiter = _Waiter(reply_to, req, deadline, nbytes, on_admit, on_duplicate, on_timeout)
        self._parked_puts.append(waiter)
        self._timer(waiter.deadline, "put", waiter)

    def _fits(self, nbytes: int) -> bool:
        groups, held = self.held_groups, self.held_bytes
        if self.journal is not None:  # consumed groups whose journal copy is not written hold memory too
            groups += self.journal.backlog_groups
            held += self.journal.backlog_bytes
        return groups < self.cfg.capacity_groups and held + nbytes <= self.cfg.capacity_bytes

    def _admit_parked(self) -> None:
        while self._parked_puts:
            waiter = self._parked_puts[0]
            if waiter.done:
                self._parked_puts.popleft()
                continue
            if self._is_seen(waiter.req.meta):
                self._parked_puts.popleft()
                waiter.done = True
                self._part(waiter.req.partition).counters.duplicates_total += 1
                self._guarded(waiter.reply_to, waiter.req.req_id, waiter.on_duplicate)
                continue
            if not self._fits(waiter.nbytes):
                return
            self._parked_puts.popleft()
            waiter.done = True
            self._guarded(waiter.reply_to, waiter.req.req_id, waiter.on_admit)

    def _guarded(self, reply_to: ReplyTo, req_id: int, fn: Callable[[], None]) -> None:
        """Run a deferred handler; its failure becomes an error reply to its own requester only."""
        try:
            fn()
        except WireError as err:
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, err.kind, err.message))
        except Exception as err:  # noqa: BLE001 - one bad request must not stop the loop
            log.exception("deferred request failed")
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, "internal", repr(err)))

    # --------------------------------------------------------------------------------------- puts
    def handle_put(self, unit_index: int, reply_to: ReplyTo, req: P.PutRequest, buffers: list[Any]) -> None:
        nbytes = validate_group(req.meta, req.tensors, [len(b) for b in buffers])

        def store() -> None:
            token = next(self._tokens)
            self.units[unit_index].store(token, buffers)
            group = _Group(next(self._seq), req.partition, req.meta, req.tensors, nbytes, unit_index, token)
            group.num_buffers = len(buffers)
            self._hold(group)
            self._ok(reply_to, P.PutReply(req.req_id, True))  # before a waiting lease is served from it
            self._make_ready(group)

        self._admit(req, nbytes, reply_to, store, lambda: self._ok(reply_to, P.PutReply(req.req_id, False)))

    def handle_reserve(self, reply_to: ReplyTo, req: P.ReserveRequest, _buffers: list[Any]) -> None:
        self.credits.release(req.release)
        credit = self.credits.grant(req.nbytes) if req.nbytes > 0 else None
        self._ok(reply_to, P.ReserveReply(req.req_id, credit))

    def handle_commit(self, reply_to: ReplyTo, req: P.CommitRequest, _buffers: list[Any]) -> None:
        self.credits.release(req.release)
        held = self.credits.take(req.token, req.req_id)  # ours until stored, or handed back below

        def store() -> None:
            self.credits.trim(held, req.tensors)
            group = _Group(
                next(self._seq), req.partition, req.meta, req.tensors, nbytes, held.unit, req.token
            )
            group.arena_offset, group.region_bytes, group.num_buffers = (
                held.offset,
                region_extent(req.tensors),
                1,
            )
            self._hold(group)
            credit = self.credits.grant(req.next_nbytes) if req.next_nbytes > 0 else None
            self._ok(reply_to, P.CommitReply(req.req_id, True, credit))  # before a waiting lease is served
            self._make_ready(group)

        def duplicate() -> None:
            self._ok(reply_to, P.CommitReply(req.req_id, False, self.credits.give_back(held)))

        try:
            nbytes = validate_group(req.meta, req.tensors, [held.nbytes])
            self._admit(req, nbytes, reply_to, store, duplicate, lambda: self.credits.give_back(held))
        except WireError:
            self.credits.give_back(held)  # a refused commit leaves the credit with its producer
            raise

    def _make_ready(self, group: _Group) -> None:
        group.state = READY
        part = self._part(group.partition)
        part.ready.append(group.meta.group_id)
        part.counters.on_put(group.nbytes)
        self._serve_waiters(part)

    # ------------------------------------------------------------------------------------- leases
    def handle_lease(self, reply_to: ReplyTo, req: P.LeaseRequest, _buffers: list[Any]) -> None:
        if req.n_groups < 1 or not 1 <= req.min_groups <= req.n_groups:
            raise WireError(
                "bad_request", f"need 1 <= min_groups ({req.min_groups}) <= n_groups ({req.n_groups})"
            )
        part = self._part(req.partition)
        waiter = _Waiter(reply_to, req, time.monotonic() + max(0.0, req.timeout_s))
        part.waiters.append(waiter)
        self._serve_waiters(part)
        if not waiter.done:
            self._timer(waiter.deadline, "wait", (req.partition, waiter))

    def _serve_waiters(self, part: _Partition) -> None:
        while part.waiters and (part.waiters[0].done or len(part.ready) >= part.waiters[0].req.min_groups):
            waiter = part.waiters.popleft()
            if not waiter.done:
                self._guarded(waiter.reply_to, waiter.req.req_id, lambda w=waiter: self._grant(part, w))

    def _grant(self, part: _Partition, waiter: _Waiter) -> None:
        """Lease the front of the ready set to ``waiter``; if its reply cannot be delivered (the requester is
        gone), nothing changes and the groups stay ready for the next waiter."""
        waiter.done = True
        req = waiter.req
        take = min(req.n_groups, len(part.ready))
        groups = [self._groups[gid] for gid in itertools.islice(part.ready, take)]
        lease_id = f"{self._lease_prefix}-{next(self._lease_ids)}"
        leased = [
            P.LeasedGroup(g.meta, g.specs, g.unit, g.token, g.arena_offset, g.region_bytes, g.num_buffers)
            for g in groups
        ]
        reply = P.LeaseReply(req.req_id, lease_id, self.cfg.lease_timeout_s, leased)
        if not self._ok(waiter.reply_to, reply):
            log.info("a lease waiter went away: its %d group(s) stay ready", take)
            return
        for g in groups:
            part.ready.popleft()
            g.state, g.lease_id = LEASED, lease_id
            part.counters.on_lease(g, req.consumer_version)
        deadline = time.monotonic() + self.cfg.lease_timeout_s
        self._leases[lease_id] = _Lease(lease_id, req.partition, [g.meta.group_id for g in groups], deadline)

    def _return_to_ready(self, part: _Partition, group_ids: list[str]) -> None:
        groups = sorted((self._groups[gid] for gid in group_ids), key=lambda g: g.seq)
        for g in groups:
            g.state, g.lease_id = READY, ""
        ids = [g.meta.group_id for g in groups]
        if not part.ready or groups[-1].seq < self._groups[part.ready[0]].seq:
            part.ready.extendleft(reversed(ids))
        else:
            merged = heapq.merge(ids, part.ready, key=lambda gid: self._groups[gid].seq)
            part.ready = deque(merged)
        self._serve_waiters(part)

    def handle_fetch(
        self, unit_index: int, reply_to: ReplyTo, req: P.FetchRequest, _buffers: list[Any]
    ) -> None:
        if req.lease_id not in self._leases:
            raise WireError(
                "unknown_lease", f"lease {req.lease_id!r} is unknown, acked or expired", req.req_id
            )
        unit = self.units[unit_index]
        counts, buffers = [], []
        for token in req.tokens:
            group = self._by_token.get(token)
            if group is None or group.lease_id != req.lease_id or group.unit != unit_index:
                raise WireError("bad_request", f"token {token} is not in lease {req.lease_id!r} on this unit")
            frames = unit.frames(token, group.arena_offset, group.region_bytes, self._background.track)
            buffers.extend(frames)
            counts.append(len(frames))
        self._ok(reply_to, P.FetchReply(req.req_id, counts), buffers)

    def handle_ack(self, reply_to: ReplyTo, req: P.AckRequest, _buffers: list[Any]) -> None:
        lease = self._leases.get(req.lease_id)
        if lease is None:
            self._late_ack(reply_to, req)
            return
        dropped = set(req.dropped)
        unknown = dropped.difference(lease.group_ids)
        if unknown:
            raise WireError(
                "bad_request", f"dropped group(s) {sorted(unknown)[:5]} are not in lease {req.lease_id!r}"
            )
        del self._leases[req.lease_id]
        for gid in lease.group_ids:
            self._consume(self._groups[gid], gid in dropped)
        self._ok(reply_to, P.AckReply(req.req_id, len(lease.group_ids)))
        self._admit_parked()

    def _late_ack(self, reply_to: ReplyTo, req: P.AckRequest) -> None:
        group_ids = self._expired.pop(req.lease_id, None)
        if group_ids is None:
            raise WireError(
                "unknown_lease", f"lease {req.lease_id!r} is unknown or already acked", req.req_id
            )
        acked = lost = 0
        for gid in group_ids:
            group = self._groups.get(gid)
            if group is not None and group.state == READY:
                self._part(group.partition).ready.remove(gid)
                self._consume(group, gid in req.dropped)
                acked += 1
            else:
                lost += 1
        self._ok(reply_to, P.AckReply(req.req_id, acked, lost))
        self._admit_parked()

    def _consume(self, group: _Group, dropped: bool) -> None:
        if self.journal is not None:
            self._journal(group, dropped)
        self._release(group)
        self._consumed_groups.add(group.meta.group_id)
        self._consumed_uids.update(s.uid for s in group.meta.samples)
        self._part(group.partition).counters.on_ack(dropped)
        if dropped:
            self._dropped.append(group.meta)

    def _journal(self, group: _Group, dropped: bool) -> None:
        unit = self.units[group.unit]
        if group.arena_offset >= 0:
            region = unit.arena.buffer(group.arena_offset, group.region_bytes)
            self.journal.append(group.partition, group.meta, group.seq, group.nbytes, dropped, group.unit,
                                group.specs, [region], unit.arena, group.arena_offset, group.region_bytes)  # fmt: skip
        else:
            self.journal.append(group.partition, group.meta, group.seq, group.nbytes, dropped, group.unit,
                                group.specs, unit.blobs(group.token))  # fmt: skip

    def handle_nack(self, reply_to: ReplyTo, req: P.NackRequest, _buffers: list[Any]) -> None:
        lease = self._leases.pop(req.lease_id, None)
        if lease is None:
            if req.lease_id not in self._expired:
                raise WireError(
                    "unknown_lease", f"lease {req.lease_id!r} is unknown or already acked", req.req_id
                )
        else:
            part = self._part(lease.partition)
            part.counters.nacked_total += len(lease.group_ids)
            self._return_to_ready(part, lease.group_ids)
        self._ok(reply_to, P.DoneReply(req.req_id))

    def handle_pop_dropped(self, reply_to: ReplyTo, req: P.PopDroppedRequest, _buffers: list[Any]) -> None:
        n = max(0, min(req.max_groups, len(self._dropped)))
        self._ok(reply_to, P.DroppedReply(req.req_id, [self._dropped.popleft() for _ in range(n)]))

    def forget(self, sock: Any) -> None:
        """A requester's connection closed: cancel its parked leases and puts, which can never be answered
        (a lease granted to it would hold its groups until ``lease_timeout_s``)."""
        for part in self._partitions.values():
            for waiter in part.waiters:
                if waiter.reply_to[0] is sock:
                    waiter.done = True
        for waiter in self._parked_puts:
            if not waiter.done and waiter.reply_to[0] is sock:
                waiter.done = True
                if waiter.on_timeout is not None:
                    waiter.on_timeout()
        self._admit_parked()

    # -------------------------------------------------------------------------------------- timers
    def tick(self) -> float:
        """Fire due timers and finished background work; return seconds until the next timer (capped)."""
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(self._timers)
            getattr(self, f"_expire_{kind}")(key)
        while self._leases and (lease := next(iter(self._leases.values()))).deadline <= now:
            self._expire_lease(lease.lease_id)
        credit_deadline = self.credits.expire(now)
        self._background.poll()
        if self.journal is not None and self.journal.poll():
            self._admit_parked()  # written journal copies free capacity
        deadlines = [self._timers[0][0]] if self._timers else []
        if self._leases:
            deadlines.append(next(iter(self._leases.values())).deadline)
        if credit_deadline is not None:
            deadlines.append(credit_deadline)
        wait = min(deadlines) - now if deadlines else 1.0
        if self._background.busy:
            wait = min(wait, 0.002)  # completions do not wake the poller: look again soon
        return max(0.0, min(wait, 1.0))

    def _expire_lease(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        self._expired[lease_id] = lease.group_ids
        while len(self._expired) > _EXPIRED_LEASES_KEPT:
            self._expired.popitem(last=False)
        part = self._part(lease.partition)
        part.counters.expired_total += len(lease.group_ids)
        log.warning("lease %s expired: %d group(s) back to the ready set", lease_id, len(lease.group_ids))
        self._return_to_ready(part, lease.group_ids)

    def _expire_put(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        if waiter.on_timeout is not None:
            waiter.on_timeout()
        backlog = self.journal.backlog_groups if self.journal is not None else 0
        msg = (
            f"queue full for {waiter.req.timeout_s:.1f}s: holding {self.held_groups}/{self.cfg.capacity_groups} "
            f"groups and {self.held_bytes}/{self.cfg.capacity_bytes} bytes"
            + (f" (+{backlog} acked groups still being journalled)" if backlog else "")
            + "; the consumer is not keeping up (raise queue.capacity_groups/capacity_bytes or the put timeout)"
        )
        self._send(waiter.reply_to, P.MsgType.ERROR, P.ErrorReply(waiter.req.req_id, "queue_full", msg))
        self._admit_parked()  # the next one in line may fit

    def _expire_wait(self, key: tuple[str, _Waiter]) -> None:
        partition, waiter = key
        if waiter.done:
            return
        waiter.done = True
        self._ok(waiter.reply_to, P.LeaseReply(waiter.req.req_id))
        self._serve_waiters(self._part(partition))  # a head waiter that timed out may unblock the next

    # ---------------------------------------------------------------------------------- hello, stats
    def handle_hello(self, reply_to: ReplyTo, req: P.HelloRequest, _buffers: list[Any]) -> None:
        units = [u.info() for u in self.units]
        cfg = self.cfg
        reply = P.HelloReply(
            req.req_id,
            self._nonce,
            units,
            cfg.max_message_bytes,
            cfg.inline_tensor_bytes,
            cfg.shm_min_group_bytes,
            cfg.put_timeout_s,
            self._direct,
        )
        self._ok(reply_to, reply)

    def handle_ping(self, reply_to: ReplyTo, req: P.PingRequest, _buffers: list[Any]) -> None:
        self._ok(reply_to, P.DoneReply(req.req_id))

    def handle_stats(self, reply_to: ReplyTo, req: P.StatsRequest, _buffers: list[Any]) -> None:
        self._ok(reply_to, P.StatsReply(req.req_id, self.stats()))

    def stats(self) -> P.QueueStats:
        parts = {}
        for name, part in self._partitions.items():
            leased = [self._groups[gid] for lease in self._leases.values() if lease.partition == name
                      for gid in lease.group_ids]  # fmt: skip
            ready_bytes = sum(self._groups[gid].nbytes for gid in part.ready)
            parts[name] = part.counters.snapshot(
                len(part.ready), ready_bytes, len(leased), sum(g.nbytes for g in leased)
            )
        arenas = [u.arena for u in self.units if u.arena is not None]
        return P.QueueStats(
            partitions=parts,
            held_groups=self.held_groups,
            held_bytes=self.held_bytes,
            capacity_groups=self.cfg.capacity_groups,
            capacity_bytes=self.cfg.capacity_bytes,
            puts_waiting=sum(not w.done for w in self._parked_puts),
            leases_waiting=sum(not w.done for p in self._partitions.values() for w in p.waiters),
            credits=len(self.credits),
            consumed_uids=len(self._consumed_uids),
            dropped_waiting=len(self._dropped),
            duplicates_total=sum(p.counters.duplicates_total for p in self._partitions.values()),
            shm_bytes_total=sum(a.size for a in arenas),
            shm_bytes_used=sum(a.used for a in arenas),
            journal_groups=len(self.journal) if self.journal is not None else 0,
            journal_bytes=self.journal.bytes if self.journal is not None else 0,
            journal_backlog_groups=self.journal.backlog_groups if self.journal is not None else 0,
            rate_window_s=PartitionCounters.WINDOW_S,
            uptime_s=time.monotonic() - self._started,
        )

    def close(self) -> None:
        self._background.close()
        if self.journal is not None:
            self.journal.close()
