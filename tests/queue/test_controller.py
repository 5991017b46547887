"""The queue controller as a state machine, without sockets or a server loop: each test calls its handlers
directly, records the replies its ``send`` gets, and moves its clock by hand, so every deadline (lease expiry,
a put or lease wait timing out, an arena credit lapsing) fires exactly when the test says."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from slipstream.queue import protocol as P
from slipstream.queue.arena import Arena, shm_supported
from slipstream.queue.codec import WireError, layout_region, pack_frames, write_region
from slipstream.queue.config import QueueConfig
from slipstream.queue.controller import Controller
from slipstream.queue.storage import StorageUnit
from slipstream.queue.testing import make_group

TRAINER, OTHER, PRODUCER = "trainer", "other", "producer"
OWNER, STRANGER = b"o" * 16, b"s" * 16


class Clock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Queue:
    """A controller with one storage unit (no socket), its recorded replies and its clock."""

    def __init__(self, arena: Arena | None = None, **cfg: object) -> None:
        self.clock = Clock()
        self.sent: list[tuple[str, P.MsgType, object, list]] = []
        self.gone: set[str] = set()  # requesters whose replies can no longer be delivered
        self.unit = StorageUnit(0, None, 0, arena)
        self.ctl = Controller(QueueConfig(**cfg), [self.unit], self._send, b"n" * 16, clock=self.clock)
        self._ids = iter(range(1, 1 << 30))

    def _send(self, reply_to, msg_type, header, buffers=()) -> bool:
        self.sent.append((reply_to[0], msg_type, header, list(buffers)))
        return reply_to[0] not in self.gone

    def replies(self, who: str) -> list:
        return [header for to, _, header, _ in self.sent if to == who]

    def last(self, who: str):
        replies = self.replies(who)
        return replies[-1] if replies else None

    # ------------------------------------------------------------------------------------ requests
    def put(self, gid: str, timeout_s: float = 5.0, who: str = PRODUCER, partition: str = "train") -> object:
        group = make_group(gid)
        specs, views = pack_frames(group.tensors, 0)  # every tensor a frame: stored in the blob store
        buffers = [bytes(v) for v in views]  # as the frames arrive from a socket
        req = P.PutRequest(next(self._ids), partition, group.meta, specs, timeout_s)
        before = len(self.replies(who))
        self.ctl.handle_put(0, (who, b""), req, buffers)
        return self.last(who) if len(self.replies(who)) > before else None  # None: parked

    def lease(self, n: int, who: str = TRAINER, min_groups: int | None = None, timeout_s: float = 0.0,
              owner: bytes = OWNER) -> P.LeaseReply | None:  # fmt: skip
        req = P.LeaseRequest(next(self._ids), "train", n, n if min_groups is None else min_groups, timeout_s,
                             owner=owner)  # fmt: skip
        before = len(self.replies(who))
        self.ctl.handle_lease((who, b""), req, [])
        return self.last(who) if len(self.replies(who)) > before else None

    def ack(self, lease_id: str, dropped: tuple[str, ...] = (), owner: bytes = OWNER) -> P.AckReply:
        self.ctl.handle_ack((TRAINER, b""), P.AckRequest(next(self._ids), lease_id, list(dropped), owner), [])
        return self.last(TRAINER)

    def nack(self, lease_id: str, owner: bytes = OWNER) -> None:
        self.ctl.handle_nack((TRAINER, b""), P.NackRequest(next(self._ids), lease_id, owner), [])

    def job(self, handler: Callable, name: str) -> object:
        """A snapshot or restore, run to its reply (its file IO is on the controller's worker thread)."""
        before = len(self.replies(TRAINER))
        handler((TRAINER, b""), P.PathRequest(next(self._ids), name), [])
        deadline = time.monotonic() + 30
        while len(self.replies(TRAINER)) == before:
            assert time.monotonic() < deadline, "the snapshot or restore never finished"
            self.ctl.tick()
            time.sleep(0.001)
        return self.last(TRAINER)

    def train(self):
        return self.ctl.stats().partitions["train"]


@pytest.fixture
def make_queue():
    made: list[Queue] = []

    def make(**cfg: object) -> Queue:
        queue = Queue(**cfg)
        made.append(queue)
        return queue

    yield make
    for queue in made:
        queue.ctl.close()
        queue.unit.close()


@contextmanager
def refused(kind: str, match: str | None = None) -> Iterator[None]:
    """The request fails with an error reply of ``kind`` (what the server would send back)."""
    with pytest.raises(WireError, match=match) as info:
        yield
    assert info.value.kind == kind


def _ids(reply: P.LeaseReply) -> list[str]:
    return [g.meta.group_id for g in reply.groups]


# ---------------------------------------------------------------------------------------- put, lease, ack
def test_put_lease_ack_consumes_groups_in_put_order_and_never_admits_them_again(make_queue):
    q = make_queue()
    assert q.put("a").stored and q.put("b").stored and q.put("c").stored
    reply = q.lease(2)
    assert _ids(reply) == ["a", "b"] and reply.ttl_s == q.ctl.cfg.lease_timeout_s
    assert (q.train().ready_groups, q.train().leased_groups) == (1, 2)
    assert q.ack(reply.lease_id) == P.AckReply(reply.req_id + 1, 2)
    stats = q.ctl.stats()
    assert (stats.held_groups, stats.consumed_uids, stats.partitions["train"].acked_total) == (1, 4, 2)
    assert q.put("a").stored is False  # consumed: a replayed put stores nothing
    assert q.put("c").stored is False  # held: likewise
    assert q.ctl.stats().duplicates_total == 2
    with refused("unknown_lease"):  # acked: gone
        q.ack(reply.lease_id)


def test_a_lease_waits_for_min_groups_and_an_empty_reply_ends_its_wait(make_queue):
    q = make_queue()
    assert q.lease(3, min_groups=2, timeout_s=10.0) is None
    assert q.ctl.stats().leases_waiting == 1
    q.put("a")
    assert q.last(TRAINER) is None
    q.put("b")  # the put is answered before the lease that it completes
    assert [to for to, *_ in q.sent] == [PRODUCER, PRODUCER, TRAINER]
    assert _ids(q.last(TRAINER)) == ["a", "b"] and q.ctl.stats().leases_waiting == 0

    assert q.lease(1, who=OTHER, timeout_s=5.0) is None
    q.clock.now += 4.9
    q.ctl.tick()
    assert q.last(OTHER) is None
    q.clock.now += 0.1
    q.ctl.tick()
    assert q.last(OTHER).lease_id == "" and q.ctl.stats().leases_waiting == 0


def test_waiting_leases_are_served_in_arrival_order(make_queue):
    q = make_queue()
    q.lease(1, who=TRAINER, timeout_s=10.0)
    q.lease(1, who=OTHER, timeout_s=10.0)
    q.put("a")
    assert _ids(q.last(TRAINER)) == ["a"] and q.last(OTHER) is None
    q.put("b")
    assert _ids(q.last(OTHER)) == ["b"]


def test_nack_puts_the_groups_back_in_front_in_put_order(make_queue):
    q = make_queue()
    for gid in "abc":
        q.put(gid)
    first = q.lease(2)
    q.nack(first.lease_id)
    assert q.train().nacked_total == 2
    assert _ids(q.lease(3)) == ["a", "b", "c"]
    with refused("unknown_lease"):
        q.nack(first.lease_id)


def test_groups_coming_back_interleave_with_the_ready_ones_in_put_order(make_queue):
    q = make_queue()
    for gid in "abcde":
        q.put(gid)
    a, b, c = (q.lease(1) for _ in range(3))  # ready: d e
    q.nack(a.lease_id)  # in front: a d e
    q.nack(c.lease_id)  # between: a c d e
    q.nack(b.lease_id)  # between: a b c d e
    assert _ids(q.lease(5)) == ["a", "b", "c", "d", "e"]


def test_ack_with_dropped_ids_feeds_pop_dropped_and_refuses_ids_outside_the_lease(make_queue):
    q = make_queue()
    q.put("a"), q.put("b")
    lease = q.lease(2)
    with refused("bad_request", "not in lease"):
        q.ack(lease.lease_id, dropped=("zz",))
    assert q.train().leased_groups == 2  # a refused ack changes nothing
    assert q.ack(lease.lease_id, dropped=("b",)).acked == 2
    assert (q.train().acked_total, q.train().dropped_total) == (2, 1)
    q.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(50, 10), [])
    assert [m.group_id for m in q.last(PRODUCER).groups] == ["b"]
    q.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(51, 10), [])
    assert q.last(PRODUCER).groups == []


def test_only_the_owner_of_a_lease_can_ack_or_nack_it(make_queue):
    q = make_queue()
    q.put("a")
    lease = q.lease(1)
    for call in (q.ack, q.nack):
        with refused("unknown_lease"):
            call(lease.lease_id, owner=STRANGER)
    assert q.ack(lease.lease_id).acked == 1


def test_bad_requests_are_refused_before_anything_changes(make_queue):
    q = make_queue()
    with refused("bad_request", "min_groups"):
        q.lease(2, min_groups=3)
    with refused("bad_request", "partition"):
        q.put("a", partition="no spaces")
    assert q.ctl.stats().held_groups == 0 and q.ctl.stats().leases_waiting == 0


# ------------------------------------------------------------------------------------ expiry and fences
def test_an_expired_lease_goes_back_and_a_late_ack_consumes_only_what_was_not_leased_again(make_queue):
    q = make_queue(lease_timeout_s=30.0)
    q.put("a"), q.put("b")
    first = q.lease(2)
    assert q.ctl.tick() == pytest.approx(1.0)  # capped; the lease is due in 30 s
    q.clock.now += 29.0
    assert q.ctl.tick() == pytest.approx(1.0) and q.train().leased_groups == 2
    q.clock.now += 1.0
    q.ctl.tick()
    assert (q.train().ready_groups, q.train().expired_total) == (2, 2)
    second = q.lease(1, who=OTHER)
    assert _ids(second) == ["a"]
    late = q.ack(first.lease_id)
    assert (late.acked, late.lost) == (1, 1)  # b consumed; a belongs to the second lease now
    assert (q.train().ready_groups, q.train().leased_groups, q.train().acked_total) == (0, 1, 1)
    with refused("unknown_lease"):  # a late ack counts once
        q.ack(first.lease_id)
    q.ack(second.lease_id)
    assert q.ctl.stats().held_groups == 0


def test_an_expired_lease_serves_a_lease_that_waits(make_queue):
    q = make_queue(lease_timeout_s=30.0)
    q.put("a")
    first = q.lease(1)
    assert q.lease(1, who=OTHER, timeout_s=60.0) is None
    q.clock.now += 30.0
    q.ctl.tick()
    assert _ids(q.last(OTHER)) == ["a"]
    q.nack(first.lease_id)  # expired already: its groups are back, so nothing happens
    assert q.train().leased_groups == 1


def test_a_grant_nobody_receives_leaves_the_groups_ready(make_queue):
    q = make_queue()
    q.gone.add(OTHER)
    q.lease(1, who=OTHER, timeout_s=60.0)
    q.put("a")
    assert q.train().ready_groups == 1 and q.train().leased_total == 0
    assert _ids(q.lease(1)) == ["a"]


def test_a_closed_connection_loses_its_waiting_lease(make_queue):
    q = make_queue()
    q.lease(1, who=OTHER, timeout_s=60.0)
    q.ctl.forget(OTHER)
    assert q.ctl.stats().leases_waiting == 0
    q.put("a")
    assert q.last(OTHER) is None and q.train().ready_groups == 1


# ------------------------------------------------------------------------------------------ back-pressure
def test_a_full_queue_parks_puts_until_an_ack_makes_room(make_queue):
    q = make_queue(capacity_groups=1)
    q.put("a")
    assert q.put("b", timeout_s=60.0) is None  # no reply yet: parked
    assert q.put("b", timeout_s=60.0) is None  # the same group again, parked behind it
    stats = q.ctl.stats()
    assert (stats.held_groups, stats.puts_waiting, stats.puts_waiting_bytes > 0) == (1, 2, True)
    q.ack(q.lease(1).lease_id)
    assert [r.stored for r in q.replies(PRODUCER)] == [True, True, False]  # the replay is a duplicate
    assert q.ctl.stats().puts_waiting == 0 and q.train().ready_groups == 1


def test_a_parked_put_times_out_with_queue_full(make_queue):
    q = make_queue(capacity_groups=1)
    q.put("a")
    q.put("b", timeout_s=5.0)
    q.clock.now += 5.0
    q.ctl.tick()
    error = q.last(PRODUCER)
    assert isinstance(error, P.ErrorReply) and error.kind == "queue_full" and "1/1 groups" in error.message
    assert q.ctl.stats().puts_waiting == 0
    q.ack(q.lease(1).lease_id)
    assert q.put("b").stored  # room again; nothing of the timed-out put was kept


def test_puts_beyond_the_parking_bound_are_refused_at_once(make_queue):
    q = make_queue(capacity_groups=1, max_parked_puts=1)
    q.put("a")
    q.put("b", timeout_s=60.0)
    with refused("queue_full", "max_parked_puts"):
        q.put("c", timeout_s=60.0)


# ----------------------------------------------------------------------------------- quarantine, fetch
def test_quarantine_takes_groups_out_of_their_lease_for_good(make_queue):
    q = make_queue()
    q.put("a"), q.put("b")
    lease = q.lease(2)
    req = P.QuarantineRequest(70, lease.lease_id, ["a"], "cannot unpack", OWNER)
    q.ctl.handle_quarantine((TRAINER, b""), req, [])
    assert q.train().quarantined_total == 1 and q.train().leased_groups == 1
    assert q.ack(lease.lease_id).acked == 1
    assert q.put("a").stored is False  # quarantined counts as consumed


def test_fetch_serves_the_frames_of_a_lease_and_nothing_else(make_queue):
    q = make_queue(lease_timeout_s=30.0)
    q.put("a"), q.put("b")
    lease = q.lease(1)
    token = lease.groups[0].token
    q.ctl.handle_fetch(0, (TRAINER, b""), P.FetchRequest(80, lease.lease_id, [token], OWNER), [])
    _, _, reply, frames = q.sent[-1]
    assert reply.counts == [len(frames)] and reply.counts[0] == lease.groups[0].num_buffers > 0
    other = q.ctl.ledger.groups["b"].token
    with refused("bad_request", "not in lease"):
        q.ctl.handle_fetch(0, (TRAINER, b""), P.FetchRequest(81, lease.lease_id, [other], OWNER), [])
    q.clock.now += 30.0
    q.ctl.tick()
    q.lease(1, who=OTHER)  # "a" again, to another holder
    with refused("unknown_lease", "leased again"):
        q.ctl.handle_fetch(0, (TRAINER, b""), P.FetchRequest(82, lease.lease_id, [token], OWNER), [])


# ------------------------------------------------------------------------------------ snapshot, restore
def test_a_snapshot_merges_into_a_fresh_controller(make_queue, tmp_path):
    q = make_queue(snapshot_dir=str(tmp_path))
    for gid in "abc":
        q.put(gid)
    q.ack(q.lease(1).lease_id, dropped=("a",))
    held = q.lease(1)  # leased groups are saved too
    summary = q.job(q.ctl.handle_snapshot, "step_1/queue").summary
    assert summary["groups"] == 2
    q.ack(held.lease_id)

    fresh = make_queue(snapshot_dir=str(tmp_path))
    assert fresh.lease(2, who=OTHER, timeout_s=60.0) is None  # waits for the restore
    restored = fresh.job(fresh.ctl.handle_restore, "step_1/queue").summary
    assert (restored["mode"], restored["groups"], restored["dropped"]) == ("merge", 2, 1)
    assert _ids(fresh.last(OTHER)) == ["b", "c"]
    assert fresh.put("a").stored is False  # consumed before the snapshot
    fresh.ctl.handle_pop_dropped((PRODUCER, b""), P.PopDroppedRequest(90, 10), [])
    assert [m.group_id for m in fresh.last(PRODUCER).groups] == ["a"]


def test_a_rollback_brings_back_what_was_acked_since_the_snapshot(make_queue, tmp_path):
    q = make_queue(snapshot_dir=str(tmp_path), journal=True, journal_dir=str(tmp_path))
    q.put("a"), q.put("b")
    q.job(q.ctl.handle_snapshot, "s1")
    q.ack(q.lease(1).lease_id)  # "a", journalled
    q.put("c")
    assert q.ctl.stats().journal_groups == 1
    summary = q.job(q.ctl.handle_restore, "s1").summary
    assert (summary["mode"], summary["from_journal"], summary["from_snapshot"]) == ("rollback", 1, 0)
    assert _ids(q.lease(3)) == ["a", "b", "c"]  # put order, "a" first again
    assert q.put("a").stored is False  # held again: still never twice


def test_snapshots_are_refused_without_a_snapshot_dir(make_queue):
    q = make_queue()
    with refused("bad_request", "snapshot_dir"):
        q.ctl.handle_snapshot((TRAINER, b""), P.PathRequest(1, "s"), [])


# --------------------------------------------------------------------------------------- arena credits
@pytest.mark.skipif(not shm_supported(), reason="arenas need memfd_create (Linux)")
def test_a_commit_stores_a_group_written_into_a_credit_and_an_unused_credit_lapses():
    q = Queue(arena=Arena(1 << 20, b"n" * 16, name="test-controller"), reserve_timeout_s=10.0)
    try:
        group = make_group("a")
        specs, size = layout_region(group.tensors, 0)
        q.ctl.handle_reserve((PRODUCER, b""), P.ReserveRequest(1, size, owner=OWNER), [])
        credit = q.last(PRODUCER).credit
        write_region(q.unit.arena.buffer(credit.offset, size), group.tensors, specs)
        commit = P.CommitRequest(2, credit.token, "train", group.meta, specs, 5.0, size, owner=OWNER)
        q.ctl.handle_commit((PRODUCER, b""), commit, [])
        reply = q.last(PRODUCER)
        assert reply.stored and reply.credit is not None  # the next put's credit comes with the reply
        leased = q.lease(1).groups[0]
        assert leased.arena_offset == credit.offset and leased.token == credit.token
        assert q.ctl.stats().credits == 1
        q.clock.now += 10.0
        q.ctl.tick()
        assert q.ctl.stats().credits == 0  # its producer never used it: freed
    finally:
        q.ctl.close()
        q.unit.close()
