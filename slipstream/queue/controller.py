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

The controller is the server's one state machine, built from parts it owns, each behind a narrow interface::

    Controller     handlers, admission and back-pressure, who is served when, every answer
      ├── Ledger    (state.py)     held groups, ready sets in put order, consumed ids, dropped list
      ├── Parking   (parking.py)   puts waiting for room, leases waiting for groups, their deadlines
      ├── Leases    (leases.py)    the lease table: grant, ack, nack, quarantine, fetch, expiry, fences
      ├── Recovery  (recovery.py)  snapshot and restore (rollback or merge), on the background worker
      ├── Credits   (credits.py)   arena regions reserved for producers' next puts
      └── Journal   (journal.py)   acked groups kept until the next snapshot commits (optional)

Only the controller answers requests and decides when a parked one is served; the lease table and the
recovery change the queue through the ledger and report what changed (a partition's ready set grew, groups
to consume), and the controller then serves whoever waits. Acked groups go to the journal (header and
payload, copied out of shared memory) until the next snapshot commits, so a trainer that crashes and restores
its last snapshot on this live server gets back what it acked since.

Same-host producers write into arena *credits* (regions reserved for their next put, see
:mod:`slipstream.queue.credits`): a commit both admits the group written there and hands out the next credit,
so a shared-memory put is one round trip, like a socket put.

Invariants:
  * a group id or uid is accepted at most once (``Ledger.is_seen``), so a replayed put is refused and
    nothing is trained twice;
  * a group is handed out only from READY and never after its ack; a lease whose deadline passed goes back
    to the ready set, and a late ack of it still consumes whatever of it was not leased again since (each
    group keeps its last lease id as a fence);
  * ``held_groups``/``held_bytes`` count READY + LEASED groups; capacity bounds them plus the consumed
    groups whose journal copy is not written yet (their buffers are still held).

Time comes from ``clock`` (``time.monotonic`` by default), so a test drives every deadline by hand: the
handlers can be called directly with a ``send`` that records the replies, without sockets or threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from slipstream.queue import protocol as P
from slipstream.queue.background import Background
from slipstream.queue.checks import check_lease, check_nbytes, check_wait
from slipstream.queue.codec import WireError, region_extent, validate_group
from slipstream.queue.config import QueueConfig
from slipstream.queue.credits import Credits
from slipstream.queue.journal import Journal
from slipstream.queue.leases import Leases
from slipstream.queue.parking import Parking
from slipstream.queue.recovery import Recovery, Summary
from slipstream.queue.state import Clock, Group, Ledger, ReplyTo, Send, Waiter
from slipstream.queue.stats import PartitionCounters
from slipstream.queue.storage import StorageUnit
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class Controller:
    """Metadata owner of one queue server. Not thread-safe: only the server loop thread calls it.

    Worked example (no sockets: ``send`` records the replies, the clock is driven by hand)::

        ctl = Controller(cfg, [StorageUnit(0, None, 0, None)], send, nonce, clock=clock)
        ctl.handle_put(0, producer, P.PutRequest(1, "train", meta, specs, 5.0), buffers)  # PutReply(stored)
        ctl.handle_lease(trainer, P.LeaseRequest(2, "train", 1, 1, 30.0), [])             # LeaseReply
        ctl.handle_ack(trainer, P.AckRequest(3, lease_id), [])                            # AckReply(1)
        clock.now += cfg.lease_timeout_s; ctl.tick()     # (had it not been acked: back to the ready set)
    """

    def __init__(
        self,
        cfg: QueueConfig,
        units: Sequence[StorageUnit],
        send: Send,
        nonce: bytes,
        direct: str = "",
        clock: Clock = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._direct = direct
        self.units = list(units)
        self._send = send
        self._nonce = nonce
        self._clock = clock
        self._started = clock()
        self.ledger = Ledger(self.units)
        self.leases = Leases(self.ledger, cfg.lease_timeout_s, clock)
        self.credits = Credits(self.units, self.ledger.tokens, cfg.reserve_timeout_s, clock)
        self._background = Background()
        self.journal = Journal(cfg.journal_dir) if cfg.journal else None
        self.recovery = Recovery(self.ledger, self.journal, self._background, cfg.snapshot_dir)
        self.parking = Parking(cfg)

    @property
    def held_groups(self) -> int:
        return self.ledger.held_groups

    @property
    def held_bytes(self) -> int:
        return self.ledger.held_bytes

    # -------------------------------------------------------------------------------------- helpers
    def _ok(self, reply_to: ReplyTo, header: msgspec.Struct, buffers: Sequence[Any] = ()) -> bool:
        return self._send(reply_to, P.MsgType.OK, header, buffers)

    def _guarded(self, reply_to: ReplyTo, req_id: int, fn: Callable[[], None]) -> None:
        """Run a deferred handler; its failure becomes an error reply to its own requester only."""
        try:
            fn()
        except WireError as err:
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, err.kind, err.message))
        except Exception as err:  # noqa: BLE001 - one bad request must not stop the loop
            log.exception("deferred request failed")
            self._send(reply_to, P.MsgType.ERROR, P.ErrorReply(req_id, "internal", repr(err)))

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
        part = self.ledger.part(req.partition)
        if self.ledger.is_seen(req.meta):
            part.counters.duplicates_total += 1
            on_duplicate()
            return
        if nbytes > self.cfg.capacity_bytes:
            raise WireError(
                "bad_request",
                f"group {req.meta.group_id!r} has {nbytes} bytes, more than capacity_bytes="
                f"{self.cfg.capacity_bytes}: it could never fit; raise queue.capacity_bytes",
            )
        if self.parking.first_put() is None and self._fits(nbytes):  # none waits ahead of it, and it fits
            on_admit()
            return
        deadline = self._clock() + max(0.0, req.timeout_s)
        waiter = Waiter(reply_to, req, deadline, nbytes, on_admit, on_duplicate, on_timeout)
        waiter.frame_bytes = frame_bytes
        self.parking.park_put(waiter)

    def _fits(self, nbytes: int) -> bool:
        groups, held = self.ledger.held_groups, self.ledger.held_bytes
        if self.journal is not None:  # consumed groups whose journal copy is not written hold memory too
            groups += self.journal.backlog_groups
            held += self.journal.backlog_bytes
        return groups < self.cfg.capacity_groups and held + nbytes <= self.cfg.capacity_bytes

    def _admit_parked(self) -> None:
        """Admit parked puts in arrival order while they fit (a duplicate among them is answered as one)."""
        while (waiter := self.parking.first_put()) is not None:
            if self.ledger.is_seen(waiter.req.meta):
                self.parking.settle(waiter)
                self.ledger.part(waiter.req.partition).counters.duplicates_total += 1
                self._guarded(waiter.reply_to, waiter.req.req_id, waiter.on_duplicate)
                continue
            if not self._fits(waiter.nbytes):
                return
            self.parking.settle(waiter)
            self._guarded(waiter.reply_to, waiter.req.req_id, waiter.on_admit)

    # --------------------------------------------------------------------------------------- puts
    def handle_put(self, unit_index: int, reply_to: ReplyTo, req: P.PutRequest, buffers: list[Any]) -> None:
        check_wait("PUT", req)
        nbytes = validate_group(req.meta, req.tensors, [len(b) for b in buffers], exact=True)

        def store() -> None:
            token = next(self.ledger.tokens)
            self.units[unit_index].store(token, buffers)
            group = self.ledger.new_group(req.partition, req.meta, req.tensors, nbytes, unit_index, token)
            group.num_buffers = len(buffers)
            self._store(group, P.PutReply(req.req_id, True), reply_to)

        duplicate = lambda: self._ok(reply_to, P.PutReply(req.req_id, False))  # noqa: E731
        self._admit(req, nbytes, reply_to, store, duplicate, frame_bytes=nbytes)

    def handle_reserve(self, reply_to: ReplyTo, req: P.ReserveRequest, _buffers: list[Any]) -> None:
        check_nbytes("RESERVE", "nbytes", req.nbytes, req.req_id, self.cfg)
        self.credits.release(req.release, req.owner)
        credit = self.credits.grant(req.nbytes, req.owner) if req.nbytes > 0 else None
        self._ok(reply_to, P.ReserveReply(req.req_id, credit))

    def handle_commit(self, reply_to: ReplyTo, req: P.CommitRequest, _buffers: list[Any]) -> None:
        check_wait("COMMIT", req)
        check_nbytes("COMMIT", "next_nbytes", req.next_nbytes, req.req_id, self.cfg)
        self.credits.release(req.release, req.owner)
        held = self.credits.take(req.token, req.req_id, req.owner)  # its until stored, or handed back below

        def store() -> None:
            self.credits.trim(held, req.tensors)
            group = self.ledger.new_group(req.partition, req.meta, req.tensors, nbytes, held.unit, req.token)
            group.arena_offset, group.region_bytes = held.offset, region_extent(req.tensors)
            group.num_buffers = 1
            credit = self.credits.grant(req.next_nbytes, req.owner) if req.next_nbytes > 0 else None
            self._store(group, P.CommitReply(req.req_id, True, credit), reply_to)

        def duplicate() -> None:
            self._ok(reply_to, P.CommitReply(req.req_id, False, self.credits.give_back(held)))

        try:
            nbytes = validate_group(req.meta, req.tensors, [held.nbytes])
            self._admit(req, nbytes, reply_to, store, duplicate, lambda: self.credits.give_back(held))
        except WireError:
            self.credits.give_back(held)  # a refused commit leaves the credit with its producer
            raise

    def _store(self, group: Group, reply: msgspec.Struct, reply_to: ReplyTo) -> None:
        """Hold an admitted group, answer its put, then let it serve a waiting lease."""
        self.ledger.hold(group)
        self._ok(reply_to, reply)  # before a waiting lease is served from it
        self.ledger.make_ready(group)
        self._serve_waiters(group.partition)

    def handle_pop_dropped(self, reply_to: ReplyTo, req: P.PopDroppedRequest, _buffers: list[Any]) -> None:
        self._ok(reply_to, P.DroppedReply(req.req_id, self.ledger.pop_dropped(req.max_groups)))

    # ------------------------------------------------------------------------------------- leases
    def handle_lease(self, reply_to: ReplyTo, req: P.LeaseRequest, _buffers: list[Any]) -> None:
        check_lease(req, self.cfg)
        self.ledger.part(req.partition)  # a bad name is refused before anything waits
        if self.parking.leases_full:
            self._serve_waiters(req.partition)  # drops answered waiters from the front
        if self.parking.leases_full:
            raise WireError(
                "too_many_waiting",
                f"{self.parking.waiting_leases} leases already wait for groups (queue.max_waiting_leases); "
                "retry later",
            )
        waiter = Waiter(reply_to, req, self._clock() + max(0.0, req.timeout_s))
        self.parking.park_lease(req.partition, waiter)
        self._serve_waiters(req.partition)
        if not waiter.done:
            self.parking.time_lease(req.partition, waiter)

    def _serve_waiters(self, partition: str) -> None:
        """Grant the partition's waiting leases, in arrival order, while enough groups are ready."""
        ready, line = self.ledger.part(partition).ready, self.parking.line(partition)
        while line and (line[0].done or len(ready) >= line[0].req.min_groups):
            waiter = line.popleft()
            if not waiter.done:
                self._guarded(waiter.reply_to, waiter.req.req_id, lambda w=waiter: self._grant(w))

    def _grant(self, waiter: Waiter) -> None:
        """Lease the front of the ready set to ``waiter``; if its reply cannot be delivered (the requester is
        gone), nothing changes and the groups stay ready for the next waiter."""
        self.parking.settle(waiter)
        req = waiter.req
        lease_id, groups = self.leases.offer(self.ledger.part(req.partition), req.n_groups)
        leased = [
            P.LeasedGroup(g.meta, g.specs, g.unit, g.token, g.arena_offset, g.region_bytes, g.num_buffers)
            for g in groups
        ]
        reply = P.LeaseReply(req.req_id, lease_id, self.cfg.lease_timeout_s, leased)
        if not self._ok(waiter.reply_to, reply):
            log.info("a lease waiter went away: its %d group(s) stay ready", len(groups))
            return
        self.leases.grant(lease_id, req.partition, groups, req.owner, req.consumer_version)

    def handle_fetch(
        self, unit_index: int, reply_to: ReplyTo, req: P.FetchRequest, _buffers: list[Any]
    ) -> None:
        unit = self.units[unit_index]
        counts, buffers = [], []
        for group in self.leases.fetchable(req, unit_index):
            frames = unit.frames(group.token, group.arena_offset, group.region_bytes, self._background.track)
            buffers.extend(frames)
            counts.append(len(frames))
        self._ok(reply_to, P.FetchReply(req.req_id, counts), buffers)

    def handle_ack(self, reply_to: ReplyTo, req: P.AckRequest, _buffers: list[Any]) -> None:
        consumed, lost = self.leases.ack(req)
        for group, dropped in consumed:
            self._consume(group, dropped)
        self._ok(reply_to, P.AckReply(req.req_id, len(consumed), lost))
        self._admit_parked()

    def _consume(self, group: Group, dropped: bool) -> None:
        if self.journal is not None:
            self._journal(group, dropped)
        self.ledger.consume(group, dropped)

    def _journal(self, group: Group, dropped: bool) -> None:
        unit = self.units[group.unit]
        if group.arena_offset >= 0:
            region = unit.arena.buffer(group.arena_offset, group.region_bytes)
            self.journal.append(group.partition, group.meta, group.seq, group.nbytes, dropped, group.unit,
                                group.specs, [region], unit.arena, group.arena_offset, group.region_bytes)  # fmt: skip
        else:
            self.journal.append(group.partition, group.meta, group.seq, group.nbytes, dropped, group.unit,
                                group.specs, unit.blobs(group.token))  # fmt: skip

    def handle_nack(self, reply_to: ReplyTo, req: P.NackRequest, _buffers: list[Any]) -> None:
        partition = self.leases.nack(req)
        if partition is not None:
            self._serve_waiters(partition)
        self._ok(reply_to, P.DoneReply(req.req_id))

    def handle_quarantine(self, reply_to: ReplyTo, req: P.QuarantineRequest, _buffers: list[Any]) -> None:
        """Take groups its consumer could not unpack out of their lease for good (a group redelivered after
        every expiry would fail every time, and hold the groups leased with it hostage)."""
        for group in self.leases.quarantine(req):
            gid, reason = group.meta.group_id, req.reason[:300]
            log.error("group %r quarantined: its consumer could not unpack it (%s)", gid, reason)
            self.ledger.quarantine(group)
        self._ok(reply_to, P.DoneReply(req.req_id))
        self._admit_parked()

    # ------------------------------------------------------------------------------------ recovery
    def handle_snapshot(self, reply_to: ReplyTo, req: P.PathRequest, _buffers: list[Any]) -> None:
        self.recovery.snapshot(req, lambda summary: self._answer_job(reply_to, req.req_id, summary))

    def handle_restore(self, reply_to: ReplyTo, req: P.PathRequest, _buffers: list[Any]) -> None:
        self.recovery.restore(req, lambda summary: self._answer_job(reply_to, req.req_id, summary))

    def _answer_job(self, reply_to: ReplyTo, req_id: int, summary: Callable[[], Summary]) -> None:
        """Answer a finished snapshot or restore; restored groups then serve the leases waiting for them (also
        after a restore that failed part of the way)."""
        self._guarded(reply_to, req_id, lambda: self._ok(reply_to, P.SummaryReply(req_id, summary())))
        for partition in list(self.ledger.partitions):
            self._serve_waiters(partition)

    # -------------------------------------------------------------------------------------- timers
    def tick(self) -> float:
        """Fire due timers and finished background work; return seconds until the next timer (capped)."""
        now = self._clock()
        for kind, key in self.parking.due(now):
            if kind == "put":
                self._expire_put(key)
            else:
                self._expire_wait(*key)
        for partition in self.leases.expire(now):
            self._serve_waiters(partition)
        credit_deadline = self.credits.expire(now)
        self._background.poll()
        if self.journal is not None and self.journal.poll():
            self._admit_parked()  # written journal copies free capacity
        due = (self.parking.next_deadline(), self.leases.next_deadline(), credit_deadline)
        deadlines = [d for d in due if d is not None]
        wait = min(deadlines) - now if deadlines else 1.0
        if self._background.busy:
            wait = min(wait, 0.002)  # completions do not wake the poller: look again soon
        return max(0.0, min(wait, 1.0))

    def _expire_put(self, waiter: Waiter) -> None:
        if not self.parking.settle(waiter):
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

    def _expire_wait(self, partition: str, waiter: Waiter) -> None:
        if not self.parking.settle(waiter):
            return
        self._ok(waiter.reply_to, P.LeaseReply(waiter.req.req_id))
        self._serve_waiters(partition)  # a head waiter that timed out may unblock the next

    def forget(self, sock: Any) -> None:
        """A requester's connection closed: cancel its parked leases and puts, which can never be answered
        (a lease granted to it would hold its groups until ``lease_timeout_s``)."""
        for waiter in self.parking.forget(sock):
            if waiter.on_timeout is not None:
                waiter.on_timeout()
        self._admit_parked()

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
        ledger = self.ledger
        parts = {}
        for name, part in ledger.partitions.items():
            leased = self.leases.leased_in(name)
            ready_bytes = sum(ledger.groups[gid].nbytes for gid in part.ready)
            parts[name] = part.counters.snapshot(
                len(part.ready), ready_bytes, len(leased), sum(g.nbytes for g in leased)
            )
        arenas = [u.arena for u in self.units if u.arena is not None]
        journal = self.journal
        return P.QueueStats(
            partitions=parts,
            held_groups=ledger.held_groups,
            held_bytes=ledger.held_bytes,
            capacity_groups=self.cfg.capacity_groups,
            capacity_bytes=self.cfg.capacity_bytes,
            puts_waiting=self.parking.parked_puts,
            puts_waiting_bytes=self.parking.parked_bytes,
            leases_waiting=self.parking.waiting_leases,
            credits=len(self.credits),
            consumed_uids=len(ledger.consumed_uids),
            dropped_waiting=len(ledger.dropped),
            duplicates_total=sum(p.counters.duplicates_total for p in ledger.partitions.values()),
            shm_bytes_total=sum(a.size for a in arenas),
            shm_bytes_used=sum(a.used for a in arenas),
            journal_groups=len(journal) if journal is not None else 0,
            journal_bytes=journal.bytes if journal is not None else 0,
            journal_backlog_groups=journal.backlog_groups if journal is not None else 0,
            rate_window_s=PartitionCounters.WINDOW_S,
            uptime_s=self._clock() - self._started,
        )

    def close(self) -> None:
        self._background.close()
        if self.journal is not None:
            self.journal.close()
