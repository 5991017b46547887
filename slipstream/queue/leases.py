"""Lease handlers of the controller: grant, fetch, ack, nack, expiry.

Split out of :mod:`slipstream.queue.controller` to keep each file about one thing; they use the controller's
state and run on its loop thread. The rules they keep:

* a group is handed out only from READY, to a waiter that can still be answered, in put order;
* a lease not acked within ``lease_timeout_s`` goes back to the front of the ready set in put order;
* an ack after expiry (or a fetch) is still served for the groups not leased again since: each group keeps
  the id of its last lease as a fence, so a late ack never consumes a group that another holder has.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import deque
from typing import Any

from slipstream.queue import protocol as P
from slipstream.queue.codec import WireError
from slipstream.queue.state import LEASED, READY, Group, LeaseRecord, Partition, ReplyTo, Waiter
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

_EXPIRED_LEASES_KEPT = 4096


class Leases:
    """Lease handlers of :class:`~slipstream.queue.controller.Controller` (a mixin: no state of its own)."""

    def handle_lease(self, reply_to: ReplyTo, req: P.LeaseRequest, _buffers: list[Any]) -> None:
        if req.n_groups < 1 or not 1 <= req.min_groups <= req.n_groups:
            raise WireError(
                "bad_request", f"need 1 <= min_groups ({req.min_groups}) <= n_groups ({req.n_groups})"
            )
        part = self._part(req.partition)
        if self.waiting_leases >= self.cfg.max_waiting_leases:
            self._serve_waiters(part)  # drops answered waiters from the front
        if self.waiting_leases >= self.cfg.max_waiting_leases:
            raise WireError(
                "too_many_waiting",
                f"{self.waiting_leases} leases already wait for groups (queue.max_waiting_leases); "
                "retry later",
            )
        waiter = Waiter(reply_to, req, time.monotonic() + max(0.0, req.timeout_s))
        part.waiters.append(waiter)
        self.waiting_leases += 1
        self._serve_waiters(part)
        if not waiter.done:
            self._timer(waiter.deadline, "wait", (req.partition, waiter))

    def _serve_waiters(self, part: Partition) -> None:
        while part.waiters and (part.waiters[0].done or len(part.ready) >= part.waiters[0].req.min_groups):
            waiter = part.waiters.popleft()
            if not waiter.done:
                self._guarded(waiter.reply_to, waiter.req.req_id, lambda w=waiter: self._grant(part, w))

    def _grant(self, part: Partition, waiter: Waiter) -> None:
        """Lease the front of the ready set to ``waiter``; if its reply cannot be delivered (the requester is
        gone), nothing changes and the groups stay ready for the next waiter."""
        self._settle(waiter)
        req = waiter.req
        take = min(req.n_groups, len(part.ready))
        groups = [self._groups[gid] for gid in itertools.islice(part.ready, take)]
        lease_id = secrets.token_urlsafe(16)  # unguessable, and only good with its owner's secret
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
        group_ids = [g.meta.group_id for g in groups]
        self._leases[lease_id] = LeaseRecord(lease_id, req.partition, group_ids, deadline, req.owner)

    def _return_to_ready(self, part: Partition, group_ids: list[str]) -> None:
        groups = sorted((self._groups[gid] for gid in group_ids), key=lambda g: g.seq)
        for g in groups:
            g.state = READY  # lease_id stays: the fence a late ack of that lease is checked against
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
        live = req.lease_id in self._leases  # else expired: served while its groups were not leased again
        self._owned(self._leases if live else self._expired, req, "is unknown or acked")
        unit = self.units[unit_index]
        counts, buffers = [], []
        for token in req.tokens:
            group = self._by_token.get(token)
            if group is not None and group.lease_id != req.lease_id and not live:
                raise WireError(
                    "unknown_lease", f"lease {req.lease_id!r} expired and its groups were leased again"
                )
            if group is None or group.lease_id != req.lease_id or group.unit != unit_index:
                raise WireError("bad_request", f"token {token} is not in lease {req.lease_id!r} on this unit")
            frames = unit.frames(token, group.arena_offset, group.region_bytes, self._background.track)
            buffers.extend(frames)
            counts.append(len(frames))
        self._ok(reply_to, P.FetchReply(req.req_id, counts), buffers)

    def _owned(self, table: dict[str, LeaseRecord], req: Any, why: str) -> LeaseRecord:
        """``req``'s lease in ``table`` if ``req`` comes from its owner; else an unknown_lease error (the
        same whether the id is unknown or someone else's)."""
        lease = table.get(req.lease_id)
        if lease is None or not secrets.compare_digest(lease.owner, req.owner):
            raise WireError("unknown_lease", f"lease {req.lease_id!r} {why}", req.req_id)
        return lease

    def handle_ack(self, reply_to: ReplyTo, req: P.AckRequest, _buffers: list[Any]) -> None:
        if req.lease_id not in self._leases:
            self._late_ack(reply_to, req)
            return
        lease = self._owned(self._leases, req, "is unknown or already acked")
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
        """An ack after its lease expired consumes each of its groups that was not leased again since
        (fencing: the group's last lease is still this one); the others are reported as ``lost``."""
        group_ids = self._owned(self._expired, req, "is unknown or already acked").group_ids
        del self._expired[req.lease_id]
        acked = lost = 0
        for gid in group_ids:
            group = self._groups.get(gid)
            if group is not None and group.state == READY and group.lease_id == req.lease_id:
                self._part(group.partition).ready.remove(gid)
                self._consume(group, gid in req.dropped)
                acked += 1
            else:
                lost += 1
        self._ok(reply_to, P.AckReply(req.req_id, acked, lost))
        self._admit_parked()

    def _consume(self, group: Group, dropped: bool) -> None:
        if self.journal is not None:
            self._journal(group, dropped)
        self._release(group)
        self._consumed_groups.add(group.meta.group_id)
        self._consumed_uids.update(s.uid for s in group.meta.samples)
        self._part(group.partition).counters.on_ack(dropped)
        if dropped:
            self._dropped.append(group.meta)

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
        if req.lease_id not in self._leases:  # expired already: its groups are back, nothing to do
            self._owned(self._expired, req, "is unknown or already acked")
        else:
            lease = self._owned(self._leases, req, "is unknown or already acked")
            del self._leases[req.lease_id]
            part = self._part(lease.partition)
            part.counters.nacked_total += len(lease.group_ids)
            self._return_to_ready(part, lease.group_ids)
        self._ok(reply_to, P.DoneReply(req.req_id))

    def handle_quarantine(self, reply_to: ReplyTo, req: P.QuarantineRequest, _buffers: list[Any]) -> None:
        """Take groups its consumer could not unpack out of their lease for good (a group redelivered after
        every expiry would fail every time, and hold the groups leased with it hostage)."""
        lease = self._owned(self._leases, req, "is unknown, acked or expired")
        bad = set(req.group_ids)
        unknown = bad.difference(lease.group_ids)
        if unknown:
            raise WireError(
                "bad_request", f"group(s) {sorted(unknown)[:5]} are not in lease {req.lease_id!r}"
            )
        lease.group_ids = [gid for gid in lease.group_ids if gid not in bad]
        for gid in sorted(bad):
            self._quarantine(self._groups[gid], req.reason)
        if not lease.group_ids:
            del self._leases[req.lease_id]
        self._ok(reply_to, P.DoneReply(req.req_id))
        self._admit_parked()

    def _quarantine(self, group: Group, reason: str) -> None:
        gid = group.meta.group_id
        log.error("group %r quarantined: its consumer could not unpack it (%s)", gid, reason[:300])
        self._release(group)
        self._consumed_groups.add(gid)
        self._consumed_uids.update(s.uid for s in group.meta.samples)
        self._part(group.partition).counters.quarantined_total += 1

    def _expire_lease(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        self._expired[lease_id] = lease
        while len(self._expired) > _EXPIRED_LEASES_KEPT:
            self._expired.popitem(last=False)
        part = self._part(lease.partition)
        part.counters.expired_total += len(lease.group_ids)
        log.warning("lease %s expired: %d group(s) back to the ready set", lease_id, len(lease.group_ids))
        self._return_to_ready(part, lease.group_ids)

    def _expire_wait(self, key: tuple[str, Waiter]) -> None:
        partition, waiter = key
        if not self._settle(waiter):
            return
        self._ok(waiter.reply_to, P.LeaseReply(waiter.req.req_id))
        self._serve_waiters(self._part(partition))  # a head waiter that timed out may unblock the next

    def forget(self, sock: Any) -> None:
        """A requester's connection closed: cancel its parked leases and puts, which can never be answered
        (a lease granted to it would hold its groups until ``lease_timeout_s``)."""
        for part in self._partitions.values():
            for waiter in part.waiters:
                if waiter.reply_to[0] is sock:
                    self._settle(waiter)
        for waiter in self._parked_puts:
            if waiter.reply_to[0] is sock and self._settle(waiter) and waiter.on_timeout is not None:
                waiter.on_timeout()
        self._admit_parked()
