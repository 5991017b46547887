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

Lease handlers (grant, fetch, ack, nack, expiry) live in :mod:`~slipstream.queue.leases`. Acked groups go to
the :mod:`~slipstream.queue.journal` (header and payload, copied out of shared memory) until the next
snapshot commits, so a trainer that crashes and restores its last snapshot on this live server gets back what
it acked since; snapshot and restore live in :mod:`slipstream.queue.recovery`.

Same-host producers write into arena *credits* (regions reserved for their next put, see
:mod:`slipstream.queue.credits`): a commit both admits the group written there and hands out the next credit,
so a shared-memory put is one round trip, like a socket put.

Invariants:
  * a group id or uid is accepted at most once: ``_is_seen`` covers held groups (ready, leased) and
    everything ever acked, so a replayed put is refused and nothing is trained twice;
  * a group is handed out only from READY and never after its ack; a lease whose deadline passed goes back
    to the ready set, and a late ack of it still consumes whatever of it was not leased again since (each
    group keeps its last lease id as a fence);
  * ``held_groups``/``held_bytes`` count READY + LEASED groups; capacity bounds them plus the consumed
    groups whose journal copy is not written yet (their buffers are still held).
"""

from __future__ import annotations

import heapq
import itertools
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from slipstream.queue import protocol as P
from slipstream.queue.background import Background
from slipstream.queue.codec import WireError, region_extent, validate_group
from slipstream.queue.config import QueueConfig
from slipstream.queue.credits import Credits
from slipstream.queue.journal import Journal
from slipstream.queue.leases import Leases
from slipstream.queue.recovery import Recovery
from slipstream.queue.state import READY, Group, LeaseRecord, Partition, ReplyTo, Send, Waiter
from slipstream.queue.stats import PartitionCounters
from slipstream.queue.storage import StorageUnit
from slipstream.queue.types import GroupMeta
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

_PARTITION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _waiter_of(timer: tuple[float, int, str, Any]) -> Waiter:
    key = timer[3]
    return key[1] if timer[2] == "wait" else key


class Controller(Leases, Recovery):
    """Metadata owner of one queue server. Not thread-safe: only the server loop thread calls it."""

    def __init__(
        self, cfg: QueueConfig, units: Sequence[StorageUnit], send: Send, nonce: bytes, direct: str = ""
    ) -> None:
        self.cfg = cfg
        self._direct = direct
        self.units = list(units)
        self._send = send
        self._nonce = nonce
        self._started = time.monotonic()
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._groups: dict[str, Group] = {}
        self._by_token: dict[int, Group] = {}
        self._partitions: dict[str, Partition] = {}
        # Leases have one fixed timeout, so insertion order is deadline order: expiry only looks at the
        # front (a heap of them would grow with every lease).
        self._leases: OrderedDict[str, LeaseRecord] = OrderedDict()
        self.credits = Credits(self.units, self._tokens, cfg.reserve_timeout_s)
        self._expired: OrderedDict[str, LeaseRecord] = OrderedDict()
        self._held_uids: set[str] = set()
        self._consumed_groups: set[str] = set()
        self._consumed_uids: set[str] = set()
        self._dropped: deque[GroupMeta] = deque()
        self._parked_puts: deque[Waiter] = deque()
        self._timers: list[tuple[float, int, str, Any]] = []  # parked requests, each with its own timeout
        self._timer_seq = itertools.count()
        self._background = Background()
        self.journal = Journal(cfg.journal_dir) if cfg.journal else None
        self._commits: OrderedDict[str, tuple[frozenset[str], frozenset[str]]] = OrderedDict()
        self.held_groups = 0
        self.held_bytes = 0
        self.parked_puts = 0  # parked puts and the frame bytes they hold, and leases waiting (not done)
        self.parked_bytes = 0
        self.waiting_leases = 0

    # -------------------------------------------------------------------------------------- helpers
    def _part(self, name: str) -> Partition:
        part = self._partitions.get(name)
        if part is None:
            if not _PARTITION_RE.match(name):
                raise WireError("bad_request", f"partition {name!r}: use 1-64 letters, digits, '_', '-', '.'")
            part = self._partitions[name] = Partition()
        return part

    def _timer(self, deadline: float, kind: str, key: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), kind, key))
        if len(self._timers) > 4 * (self.parked_puts + self.waiting_leases) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop answered requests from the timers and wait lists (each is otherwise kept until its deadline
        or until it reaches the front of its list, so many short waits behind a long one would pile up)."""
        self._timers = [t for t in self._timers if not _waiter_of(t).done]
        heapq.heapify(self._timers)
        self._parked_puts = deque(w for w in self._parked_puts if not w.done)
        for part in self._partitions.values():
            part.waiters = deque(w for w in part.waiters if not w.done)

    def _ok(self, reply_to: ReplyTo, header: msgspec.Struct, buffers: Sequence[Any] = ()) -> bool:
        return self._send(reply_to, P.MsgType.OK, header, buffers)

    def _is_seen(self, meta: GroupMeta) -> bool:
        gid = meta.group_id
        if gid in self._groups or gid in self._consumed_groups:
            return True
        return any(s.uid in self._held_uids or s.uid in self._consumed_uids for s in meta.samples)

    def _hold(self, group: Group) -> None:
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
        group = Group(seq, partition, meta, specs, nbytes, unit, token)
        if arena_offset >= 0:
            group.arena_offset, group.region_bytes, group.num_buffers = arena_offset, region_bytes, 1
        else:
            self.units[unit].store(token, list(buffers))
            group.num_buffers = len(buffers)
        self._hold(group)

    def _release(self, group: Group) -> None:
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
        frame_bytes: int = 0,
    ) -> None:
        """Run ``on_admit`` now or once capacity allows; ``on_duplicate`` when the group was seen; on a
        timeout, ``on_timeout`` then a QueueFull reply. ``frame_bytes``: what the request holds while
        parked."""
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
        self._check_parking(frame_bytes)
        deadline = time.monotonic() + max(0.0, req.timeout_s)
        waiter = Waiter(reply_to, req, deadline, nbytes, on_admit, on_duplicate, on_timeout)
        waiter.frame_bytes = frame_bytes
        self._parked_puts.append(waiter)
        self.parked_puts += 1
        self.parked_bytes += frame_bytes
        self._timer(waiter.deadline, "put", waiter)

    def _check_parking(self, frame_bytes: int) -> None:
        """Refuse to park one more put beyond ``max_parked_puts`` / ``max_parked_put_bytes``."""
        cfg = self.cfg
        if (
            self.parked_puts < cfg.max_parked_puts
            and self.parked_bytes + frame_bytes <= cfg.max_parked_put_bytes
        ):
            return
        raise WireError(
            "queue_full",
            f"queue full and {self.parked_puts} put(s) holding {self.parked_bytes} bytes already wait for "
            f"room (queue.max_parked_puts={cfg.max_parked_puts}, "
            f"max_parked_put_bytes={cfg.max_parked_put_bytes}); retry later",
        )

    def _settle(self, waiter: Waiter) -> bool:
        """Mark a parked request answered or abandoned (False if it already was); frees its parking share."""
        if waiter.done:
            return False
        waiter.done = True
        if waiter.is_put:
            self.parked_puts -= 1
            self.parked_bytes -= waiter.frame_bytes
        else:
            self.waiting_leases -= 1
        return True

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
                self._settle(waiter)
                self._part(waiter.req.partition).counters.duplicates_total += 1
                self._guarded(waiter.reply_to, waiter.req.req_id, waiter.on_duplicate)
                continue
            if not self._fits(waiter.nbytes):
                return
            self._parked_puts.popleft()
            self._settle(waiter)
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
        nbytes = validate_group(req.meta, req.tensors, [len(b) for b in buffers], exact=True)

        def store() -> None:
            token = next(self._tokens)
            self.units[unit_index].store(token, buffers)
            group = Group(next(self._seq), req.partition, req.meta, req.tensors, nbytes, unit_index, token)
            group.num_buffers = len(buffers)
            self._hold(group)
            self._ok(reply_to, P.PutReply(req.req_id, True))  # before a waiting lease is served from it
            self._make_ready(group)

        duplicate = lambda: self._ok(reply_to, P.PutReply(req.req_id, False))  # noqa: E731
        self._admit(req, nbytes, reply_to, store, duplicate, frame_bytes=nbytes)

    def handle_reserve(self, reply_to: ReplyTo, req: P.ReserveRequest, _buffers: list[Any]) -> None:
        self.credits.release(req.release, req.owner)
        credit = self.credits.grant(req.nbytes, req.owner) if req.nbytes > 0 else None
        self._ok(reply_to, P.ReserveReply(req.req_id, credit))

    def handle_commit(self, reply_to: ReplyTo, req: P.CommitRequest, _buffers: list[Any]) -> None:
        self.credits.release(req.release, req.owner)
        held = self.credits.take(req.token, req.req_id, req.owner)  # its until stored, or handed back below

        def store() -> None:
            self.credits.trim(held, req.tensors)
            group = Group(next(self._seq), req.partition, req.meta, req.tensors, nbytes, held.unit, req.token)
            group.arena_offset, group.region_bytes, group.num_buffers = (
                held.offset,
                region_extent(req.tensors),
                1,
            )
            self._hold(group)
            credit = self.credits.grant(req.next_nbytes, req.owner) if req.next_nbytes > 0 else None
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

    def _make_ready(self, group: Group) -> None:
        group.state = READY
        part = self._part(group.partition)
        part.ready.append(group.meta.group_id)
        part.counters.on_put(group.nbytes)
        self._serve_waiters(part)

    def handle_pop_dropped(self, reply_to: ReplyTo, req: P.PopDroppedRequest, _buffers: list[Any]) -> None:
        n = max(0, min(req.max_groups, len(self._dropped)))
        self._ok(reply_to, P.DroppedReply(req.req_id, [self._dropped.popleft() for _ in range(n)]))

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

    def _expire_put(self, waiter: Waiter) -> None:
        if not self._settle(waiter):
            return
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
            puts_waiting=self.parked_puts,
            puts_waiting_bytes=self.parked_bytes,
            leases_waiting=self.waiting_leases,
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
