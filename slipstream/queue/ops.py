"""What each client call says to the server, written once for the sync and the async client.

Every operation is a generator that *yields* the requests it needs (a :class:`Call`, or a list of calls to
send at once, e.g. fetches from several storage units) and receives their decoded replies; the client's
driver does the socket IO (blocking in :class:`~slipstream.queue.client.QueueClient`, awaiting in
:class:`~slipstream.queue.client.AsyncQueueClient`) and throws :class:`QueueError` back into the generator
when a request fails. So the protocol logic (write into an arena credit → commit; lease → fetch what is not
in shared memory → assemble) exists once and both clients behave identically.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.queue import direct
from slipstream.queue import protocol as P
from slipstream.queue.arena import ArenaMapping
from slipstream.queue.base import Lease
from slipstream.queue.codec import (
    DTYPE_NAMES,
    as_buffer,
    layout_region,
    layout_shapes,
    pack_frames,
    unpack,
    write_region,
)
from slipstream.queue.errors import QueueError, QueueFull
from slipstream.queue.types import COLUMN_DTYPES, PROMPT_COLUMNS, GroupMeta, TrajectoryGroup
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

CONTROLLER = -1


@dataclass
class Call:
    target: int  # CONTROLLER or a storage unit index
    msg_type: P.MsgType
    header: Any  # a request Struct; the driver fills in req_id
    buffers: Sequence[Any] = ()
    # How long the server may legitimately hold the request (a lease or put wait) before answering.
    server_wait_s: float = 0.0
    # Reply as (header, frames) instead of the header alone.
    with_buffers: bool = False


_MAX_CREDITS = 4  # arena credits a client keeps (one per concurrent put is enough)


@dataclass
class Session:
    """What a client learned from HELLO, plus the arena credits it holds."""

    units: list[P.UnitInfo]
    inline_tensor_bytes: int
    shm_min_group_bytes: int
    put_timeout_s: float
    nonce: bytes = b""  # the server's, random per server process: a new one means it restarted
    direct: str = ""  # the direct channel's endpoint when this client reaches it (same host), else ""
    arenas: list[ArenaMapping] = field(default_factory=list)  # all units' arenas, or empty
    # (credit, monotonic time until which it may be written: half its ttl, see credits.py)
    credits: list[tuple[P.Credit, float]] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)

    @property
    def shared_memory(self) -> bool:
        return bool(self.arenas)

    def take_credit(self, nbytes: int, min_left_s: float = 0.0) -> tuple[P.Credit, float] | None:
        """A held credit of at least ``nbytes`` that may still be written for ``min_left_s`` or more, removed
        from the pool, with the time until which it may be written."""
        now = time.monotonic()
        found, keep = None, []
        for credit, usable_until in self.credits:
            if now >= usable_until:
                self.releases.append(credit.token)
            elif found is None and credit.nbytes >= nbytes and usable_until - now >= min_left_s:
                found = (credit, usable_until)
            else:
                keep.append((credit, usable_until))
        if found is None:  # a reserve follows: give back credits too small for the sizes now being put
            self.releases.extend(c.token for c, _ in keep)
            keep = []
        self.credits = keep
        return found

    def add_credit(self, credit: P.Credit | None) -> None:
        if credit is None:
            return
        self.credits.append((credit, time.monotonic() + credit.ttl_s / 2))
        while len(self.credits) > _MAX_CREDITS:
            self.releases.append(self.credits.pop(0)[0].token)

    def drain_releases(self) -> list[int]:
        out, self.releases = self.releases, []
        return out

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()
        self.arenas = []


Op = Generator[Call | list[Call], Any, Any]


def hello(shared_memory: bool, ipc: bool = True) -> Op:
    reply: P.HelloReply = yield Call(CONTROLLER, P.MsgType.HELLO, P.HelloRequest(0))
    session = Session(
        reply.units, reply.inline_tensor_bytes, reply.shm_min_group_bytes, reply.put_timeout_s, reply.nonce
    )
    if ipc and direct.reachable(reply.direct):
        session.direct = reply.direct
    if shared_memory and reply.units and all(u.shm_path for u in reply.units):
        arenas = [ArenaMapping.open(u.shm_path, u.shm_size, reply.nonce) for u in reply.units]
        if all(a is not None for a in arenas):
            session.arenas = arenas  # type: ignore[assignment]
        else:
            for a in arenas:
                if a is not None:
                    a.close()
    return session


def put(session: Session, group: TrajectoryGroup, partition: str, timeout_s: float | None) -> Op:
    group.validate()
    if timeout_s is None:
        timeout_s = session.put_timeout_s
    placed, group.placement = group.placement, None  # one put per allocation
    if placed is not None:
        stored = yield from _put_placed(session, group, placed, partition, timeout_s)
        if stored is not None:
            return stored
    if session.shared_memory and group.nbytes >= session.shm_min_group_bytes:
        stored = yield from _put_arena(session, group, partition, timeout_s)
        if stored is not None:
            return stored
        # no arena room right now; the socket has no such limit
    specs, buffers = pack_frames(group.tensors, session.inline_tensor_bytes)
    unit = P.unit_for(group.group_id, len(session.units))
    if session.direct and not buffers:
        unit = CONTROLLER  # the whole group fits in the header: the direct channel takes it
    request = P.PutRequest(0, partition, group.meta, specs, timeout_s)
    put_reply: P.PutReply = yield Call(unit, P.MsgType.PUT, request, buffers, server_wait_s=timeout_s)
    return put_reply.stored


def _put_arena(session: Session, group: TrajectoryGroup, partition: str, timeout_s: float) -> Op:
    """Write the group into an arena credit and commit it (one round trip with a credit in hand, two
    without); None when the socket is the better way (no room in the arena, or nothing to put there)."""
    specs, size = layout_region(group.tensors, session.inline_tensor_bytes)
    if size == 0:
        return None  # every tensor rides inline: a socket put carries it all in its header
    held = yield from _credit(session, size)
    if held is None:
        return None
    credit = held[0]
    write_region(session.arenas[credit.unit].buffer(credit.offset, size), group.tensors, specs)
    return (yield from _commit(session, credit, group, specs, size, partition, timeout_s))


def _credit(session: Session, size: int, min_left_s: float = 0.0) -> Op:
    """A credit of at least ``size`` bytes and the time until which it may be written: a held one, or a new
    one (a RESERVE round trip); None when the arena has no room now."""
    held = session.take_credit(size, min_left_s)
    if held is not None:
        return held
    request = P.ReserveRequest(0, size, session.drain_releases())
    reserved: P.ReserveReply = yield Call(CONTROLLER, P.MsgType.RESERVE, request)
    if reserved.credit is None:
        return None
    return reserved.credit, time.monotonic() + reserved.credit.ttl_s / 2


def _commit(
    session: Session,
    credit: P.Credit,
    group: TrajectoryGroup,
    specs: list[P.TensorSpec],
    size: int,
    partition: str,
    timeout_s: float,
) -> Op:
    """Commit a group written into ``credit``'s region; the reply brings the credit of the next put."""
    commit = P.CommitRequest(
        0, credit.token, partition, group.meta, specs, timeout_s, size, session.drain_releases()
    )
    try:
        reply: P.CommitReply = yield Call(CONTROLLER, P.MsgType.COMMIT, commit, server_wait_s=timeout_s)
    except QueueFull:
        session.add_credit(credit)  # the server handed it back
        raise
    except QueueError:
        # Never write it again; ask for it to be freed (a no-op if the commit did store the group).
        session.releases.append(credit.token)
        raise
    session.add_credit(reply.credit)  # the next credit, or this one again after a duplicate
    return reply.stored


@dataclass
class Placement:
    """Where an allocated group's tensors lie: the credit whose region holds them, their specs there, the
    address of each view (to notice a tensor the producer replaced), and until when it may be written."""

    session: Session
    credit: P.Credit
    specs: list[P.TensorSpec]
    size: int
    usable_until: float
    ptrs: dict[str, int]


def alloc_group(
    session: Session, meta: GroupMeta, extra: Mapping[str, tuple[Sequence[int], torch.dtype]]
) -> Op:
    """A group whose tensors are views of an arena credit (plain tensors when there is no arena room)."""
    n_prompt = sum(s.prompt_len for s in meta.samples)
    n_response = sum(s.response_len for s in meta.samples)
    shapes = {name: ([n_prompt if name in PROMPT_COLUMNS else n_response], dtype)
              for name, dtype in COLUMN_DTYPES.items()}  # fmt: skip
    for name, (shape, dtype) in extra.items():
        if name in shapes:
            raise ValueError(f"extra tensor `{name}` would replace a standard column of the group")
        shapes[name] = (list(shape), dtype)
    specs, size = layout_shapes(shapes)
    held = (yield from _credit(session, size, ALLOC_WINDOW_S)) if session.shared_memory and size else None
    if held is None:
        return TrajectoryGroup(
            meta, {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        )
    credit, usable_until = held
    tensors = unpack(specs, [session.arenas[credit.unit].buffer(credit.offset, size)])
    ptrs = {name: t.data_ptr() for name, t in tensors.items() if t.numel()}
    placement = Placement(session, credit, specs, size, usable_until, ptrs)
    return TrajectoryGroup(meta, tensors, placement=placement)


# A credit taken for alloc_group must leave the producer this long to fill the group before it must be put.
ALLOC_WINDOW_S = 5.0


def _put_placed(
    session: Session, group: TrajectoryGroup, placed: Placement, partition: str, timeout_s: float
) -> Op:
    """Commit an allocated group where it lies (copying only tensors the producer replaced); None when its
    tensors no longer match the allocation (the caller then puts it the usual way)."""
    if placed.session is not session:
        raise QueueError("this group was allocated by another queue client; put it through that one")
    if time.monotonic() > placed.usable_until:
        session.releases.append(placed.credit.token)
        raise QueueError(
            "an allocated group must be put within half of the server's reserve_timeout_s of alloc_group "
            "(its region may be handed to another producer after that); allocate again and refill"
        )
    by_name = {spec.name: spec for spec in placed.specs}
    if set(group.tensors) != set(by_name):
        session.releases.append(placed.credit.token)
        return None
    region = session.arenas[placed.credit.unit].buffer(placed.credit.offset, placed.size)
    for name, tensor in group.tensors.items():
        spec = by_name[name]
        if list(tensor.shape) != spec.shape or DTYPE_NAMES.get(tensor.dtype) != spec.dtype:
            session.releases.append(placed.credit.token)
            return None
        if tensor.numel() and tensor.data_ptr() != placed.ptrs[name]:
            write_region(region, {name: tensor}, [spec])  # replaced by the producer: copy just this one
    return (
        yield from _commit(session, placed.credit, group, placed.specs, placed.size, partition, timeout_s)
    )


def release_credits(session: Session) -> Op:
    """Give every held credit back (when a client closes), so the arena need not wait for them to lapse."""
    tokens = session.drain_releases() + [c.token for c, _ in session.credits]
    session.credits = []
    if tokens:
        yield Call(CONTROLLER, P.MsgType.RESERVE, P.ReserveRequest(0, 0, tokens))


def lease(
    session: Session,
    n_groups: int,
    partition: str,
    timeout_s: float,
    min_groups: int | None,
    consumer_version: int | None,
) -> Op:
    min_groups = n_groups if min_groups is None else min_groups
    until = time.monotonic() + timeout_s
    while True:
        wait_s = max(0.0, until - time.monotonic())
        request = P.LeaseRequest(0, partition, n_groups, min_groups, wait_s, consumer_version)
        reply: P.LeaseReply = yield Call(CONTROLLER, P.MsgType.LEASE, request, server_wait_s=wait_s)
        if not reply.lease_id:
            return None
        deadline = time.time() + reply.ttl_s
        try:
            buffers = yield from _buffers(session, reply)
        except BaseException:  # give the groups back now
            yield Call(CONTROLLER, P.MsgType.NACK, P.NackRequest(0, reply.lease_id))
            raise
        groups = yield from _unpack(reply, buffers)
        if groups:
            return Lease(reply.lease_id, groups, deadline)
        # every group was quarantined (and the lease with them): wait for others


def _unpack(reply: P.LeaseReply, buffers: list[list[Any]]) -> Op:
    """The leased groups as tensors. A group that cannot be unpacked is quarantined on the server (taken out
    of the lease, never delivered again) instead of failing the whole lease after every expiry."""
    groups, bad, reasons = [], [], []
    for leased, group_buffers in zip(reply.groups, buffers, strict=True):
        try:
            group = TrajectoryGroup(leased.meta, unpack(leased.tensors, group_buffers))
            group.validate()
        except Exception as err:  # noqa: BLE001 - whatever a malformed group raises
            bad.append(leased.meta.group_id)
            reasons.append(f"{leased.meta.group_id}: {err!r}"[:300])
            continue
        groups.append(group)
    if bad:
        reason = "; ".join(reasons)[:2000]
        log.error("quarantining %d leased group(s) that cannot be unpacked: %s", len(bad), reason)
        yield Call(CONTROLLER, P.MsgType.QUARANTINE, P.QuarantineRequest(0, reply.lease_id, bad, reason))
    return groups


def _buffers(session: Session, reply: P.LeaseReply) -> Generator[Any, Any, list[list[Any]]]:
    """Each leased group's buffers: arena views where mapped, else fetched from the units in parallel."""
    out: list[list[Any]] = [[] for _ in reply.groups]
    wanted: dict[int, list[int]] = {}  # unit -> indexes into reply.groups
    for i, g in enumerate(reply.groups):
        if g.arena_offset >= 0 and session.shared_memory:
            out[i] = [session.arenas[g.unit].buffer(g.arena_offset, g.region_bytes)]
        elif g.num_buffers:
            wanted.setdefault(g.unit, []).append(i)
    if not wanted:
        return out
    calls = [
        Call(
            unit,
            P.MsgType.FETCH,
            P.FetchRequest(0, reply.lease_id, [reply.groups[i].token for i in idx]),
            with_buffers=True,
        )
        for unit, idx in wanted.items()
    ]
    replies = yield calls
    for (_unit, idx), fetched in zip(wanted.items(), replies, strict=True):
        header, frames = fetched
        pos = 0
        for i, count in zip(idx, header.counts, strict=True):
            out[i] = [as_buffer(f) for f in frames[pos : pos + count]]
            pos += count
    return out


def ack(lease_id: str, dropped: Sequence[str]) -> Op:
    reply: P.AckReply = yield Call(CONTROLLER, P.MsgType.ACK, P.AckRequest(0, lease_id, list(dropped)))
    if reply.lost:
        log.warning(
            "lease %s had expired: %d group(s) consumed now, %d had already been handed out again",
            lease_id,
            reply.acked,
            reply.lost,
        )


def nack(lease_id: str) -> Op:
    yield Call(CONTROLLER, P.MsgType.NACK, P.NackRequest(0, lease_id))


def pop_dropped(max_groups: int) -> Op:
    reply: P.DroppedReply = yield Call(CONTROLLER, P.MsgType.POP_DROPPED, P.PopDroppedRequest(0, max_groups))
    return list(reply.groups)


def stats() -> Op:
    reply: P.StatsReply = yield Call(CONTROLLER, P.MsgType.STATS, P.StatsRequest(0))
    return reply.stats


def path_request(msg_type: P.MsgType, path: str, wait_s: float) -> Op:
    reply: P.SummaryReply = yield Call(CONTROLLER, msg_type, P.PathRequest(0, path), server_wait_s=wait_s)
    return dict(reply.summary)


def raise_for(reply: Any) -> Any:
    """The reply itself, or the QueueError an ERROR reply stands for."""
    if isinstance(reply, P.ErrorReply):
        if reply.kind == "queue_full":
            raise QueueFull(reply.message)
        raise QueueError(f"{reply.kind}: {reply.message}")
    return reply
