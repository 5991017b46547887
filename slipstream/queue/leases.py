"""The lease table of a queue server: who holds which groups, until when, and the fences of expired leases.

The controller owns one :class:`Leases` and drives it: it decides *when* to grant (a waiting lease request
meets enough ready groups) and answers the requests; the table decides *what* a grant, an ack, a nack, a
quarantine or an expiry does to the groups, through the controller's :class:`~slipstream.queue.state.Ledger`.
It sends nothing and parks nothing. The rules it keeps:

* a group is handed out only from READY, in put order;
* a lease not acked within ``lease_timeout_s`` goes back to the front of the ready set in put order;
* an ack after expiry (or a fetch) is still served for the groups not leased again since: each group keeps
  the id of its last lease as a fence, so a late ack never consumes a group that another holder has;
* only the client a lease was granted to (its ``owner`` secret) can ack, nack, fetch or quarantine it; an
  unknown id and someone else's read the same (``unknown_lease``).

Lifecycle of a lease::

    grant ──► live ──ack──► gone (its groups consumed)
               │  └─nack / quarantine of all its groups──► gone (groups ready again / consumed)
               └─deadline──► expired (groups ready again; kept as a fence for a late ack or fetch)
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from slipstream.queue import protocol as P
from slipstream.queue.codec import WireError
from slipstream.queue.state import LEASED, READY, Clock, Group, LeaseRecord, Ledger, Partition
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

_EXPIRED_LEASES_KEPT = 4096

_ByLease = P.AckRequest | P.NackRequest | P.QuarantineRequest | P.FetchRequest  # requests naming a lease


class Leases:
    """Live leases in deadline order (one fixed timeout, so insertion order: expiry only looks at the front,
    where a heap would grow with every lease) and the last expired ones. Not thread-safe."""

    def __init__(self, ledger: Ledger, timeout_s: float, clock: Clock) -> None:
        self.ledger = ledger
        self.timeout_s = timeout_s
        self._clock = clock
        self._live: OrderedDict[str, LeaseRecord] = OrderedDict()
        self._expired: OrderedDict[str, LeaseRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    # ---------------------------------------------------------------------------------------- grant
    def offer(self, part: Partition, n_groups: int) -> tuple[str, list[Group]]:
        """A fresh lease id and the groups a grant of ``n_groups`` would take (changes nothing: the grant
        happens with :meth:`grant` once its reply was delivered)."""
        lease_id = secrets.token_urlsafe(16)  # unguessable, and only good with its owner's secret
        return lease_id, self.ledger.front(part, n_groups)

    def grant(
        self, lease_id: str, partition: str, groups: list[Group], owner: bytes, consumer_version: int | None
    ) -> None:
        """Lease the front ``groups`` of ``partition``'s ready set (as :meth:`offer` gave them)."""
        part = self.ledger.part(partition)
        self.ledger.take_front(part, len(groups))
        for g in groups:
            g.state, g.lease_id = LEASED, lease_id
            part.counters.on_lease(g, consumer_version)
        group_ids = [g.meta.group_id for g in groups]
        deadline = self._clock() + self.timeout_s
        self._live[lease_id] = LeaseRecord(lease_id, partition, group_ids, deadline, owner)

    # ------------------------------------------------------------------------------------ ack, nack
    def ack(self, req: P.AckRequest) -> tuple[list[tuple[Group, bool]], int]:
        """The groups an ack consumes, each with whether it was dropped, and how many it lost (leased again
        after its lease expired). The caller consumes them; the lease is gone either way."""
        if req.lease_id not in self._live:
            return self._late_ack(req)
        lease = self._owned(self._live, req, "is unknown or already acked")
        dropped = set(req.dropped)
        unknown = dropped.difference(lease.group_ids)
        if unknown:
            raise WireError(
                "bad_request", f"dropped group(s) {sorted(unknown)[:5]} are not in lease {req.lease_id!r}"
            )
        del self._live[req.lease_id]
        return [(self.ledger.groups[gid], gid in dropped) for gid in lease.group_ids], 0

    def _late_ack(self, req: P.AckRequest) -> tuple[list[tuple[Group, bool]], int]:
        """An ack after its lease expired takes each of its groups that was not leased again since (fencing:
        the group's last lease is still this one) out of the ready set; the others are lost."""
        group_ids = self._owned(self._expired, req, "is unknown or already acked").group_ids
        del self._expired[req.lease_id]
        taken: list[tuple[Group, bool]] = []
        for gid in group_ids:
            group = self.ledger.groups.get(gid)
            if group is not None and group.state == READY and group.lease_id == req.lease_id:
                self.ledger.take_ready(group)
                taken.append((group, gid in req.dropped))
        return taken, len(group_ids) - len(taken)

    def nack(self, req: P.NackRequest) -> str | None:
        """Give a live lease's groups back to the ready set; the partition they went back to, or None when
        the lease had expired already (its groups are back, nothing to do)."""
        if req.lease_id not in self._live:
            self._owned(self._expired, req, "is unknown or already acked")
            return None
        lease = self._owned(self._live, req, "is unknown or already acked")
        del self._live[req.lease_id]
        part = self.ledger.part(lease.partition)
        part.counters.nacked_total += len(lease.group_ids)
        self.ledger.return_to_ready(part, lease.group_ids)
        return lease.partition

    def quarantine(self, req: P.QuarantineRequest) -> list[Group]:
        """Take ``req.group_ids`` out of their live lease for good (the lease ends with its last group); the
        caller releases them."""
        lease = self._owned(self._live, req, "is unknown, acked or expired")
        bad = set(req.group_ids)
        unknown = bad.difference(lease.group_ids)
        if unknown:
            raise WireError(
                "bad_request", f"group(s) {sorted(unknown)[:5]} are not in lease {req.lease_id!r}"
            )
        lease.group_ids = [gid for gid in lease.group_ids if gid not in bad]
        if not lease.group_ids:
            del self._live[req.lease_id]
        return [self.ledger.groups[gid] for gid in sorted(bad)]

    # ---------------------------------------------------------------------------------------- fetch
    def fetchable(self, req: P.FetchRequest, unit_index: int) -> list[Group]:
        """The groups of ``req.tokens`` a fetch from unit ``unit_index`` may read: all in ``req``'s lease,
        or in its expired lease and not leased again since."""
        live = req.lease_id in self._live
        self._owned(self._live if live else self._expired, req, "is unknown or acked")
        groups = []
        for token in req.tokens:
            group = self.ledger.by_token.get(token)
            if group is not None and group.lease_id != req.lease_id and not live:
                raise WireError(
                    "unknown_lease", f"lease {req.lease_id!r} expired and its groups were leased again"
                )
            if group is None or group.lease_id != req.lease_id or group.unit != unit_index:
                raise WireError("bad_request", f"token {token} is not in lease {req.lease_id!r} on this unit")
            groups.append(group)
        return groups

    # ------------------------------------------------------------------------------------------ expiry
    def expire(self, now: float) -> list[str]:
        """Return the groups of every lease past its deadline to the ready set; the partitions they went to."""
        partitions = []
        while self._live and (lease := next(iter(self._live.values()))).deadline <= now:
            del self._live[lease.lease_id]
            self._expired[lease.lease_id] = lease
            while len(self._expired) > _EXPIRED_LEASES_KEPT:
                self._expired.popitem(last=False)
            part = self.ledger.part(lease.partition)
            part.counters.expired_total += len(lease.group_ids)
            log.warning(
                "lease %s expired: %d group(s) back to the ready set", lease.lease_id, len(lease.group_ids)
            )
            self.ledger.return_to_ready(part, lease.group_ids)
            partitions.append(lease.partition)
        return partitions

    def next_deadline(self) -> float | None:
        return next(iter(self._live.values())).deadline if self._live else None

    def leased_in(self, partition: str) -> list[Group]:
        """The groups live leases of ``partition`` hold (for the statistics)."""
        return [self.ledger.groups[gid] for lease in self._live.values() if lease.partition == partition
                for gid in lease.group_ids]  # fmt: skip

    @staticmethod
    def _owned(table: dict[str, LeaseRecord], req: _ByLease, why: str) -> LeaseRecord:
        """``req``'s lease in ``table`` if ``req`` comes from its owner; else an unknown_lease error (the
        same whether the id is unknown or someone else's)."""
        lease = table.get(req.lease_id)
        if lease is None or not secrets.compare_digest(lease.owner, req.owner):
            raise WireError("unknown_lease", f"lease {req.lease_id!r} {why}", req.req_id)
        return lease
