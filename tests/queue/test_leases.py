"""Who may hold a lease: a waiter that went away is granted nothing, lease ids are unguessable and bound to
the client that got them, and an ack after expiry is fenced by whether the group was leased again."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import pytest
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.client import QueueClient, QueueError
from slipstream.queue.codec import Codec, pack_frames
from slipstream.queue.config import QueueConfig
from slipstream.queue.controller import Controller
from slipstream.queue.storage import StorageUnit
from slipstream.queue.testing import make_group


def _wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _Replies:
    """A controller's ``send``: records every reply; requesters named "gone" cannot be reached."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, object]] = []

    def __call__(self, reply_to, msg_type, header, buffers=()) -> bool:
        self.sent.append((reply_to[0], header))
        return reply_to[0] != "gone"

    def last(self, requester: str):
        return next(h for who, h in reversed(self.sent) if who == requester)


def _controller(**cfg) -> tuple[Controller, _Replies]:
    replies = _Replies()
    units = [StorageUnit(0, None, 0, None)]
    return Controller(QueueConfig(**cfg), units, replies, b"n" * 16), replies


def _put(ctl: Controller, gid: str, req_id: int = 100) -> None:
    group = make_group(gid)
    specs, buffers = pack_frames(group.tensors, 512)
    ctl.handle_put(0, ("producer", b""), P.PutRequest(req_id, "train", group.meta, specs, 1.0), buffers)


def test_a_grant_that_cannot_be_delivered_leaves_the_groups_ready():
    ctl, replies = _controller(lease_timeout_s=600)
    ctl.handle_lease(("gone", b""), P.LeaseRequest(1, "train", 1, 1, 300.0), [])
    _put(ctl, "a")
    part = ctl.stats().partitions["train"]
    assert (part.ready_groups, part.leased_groups, part.leased_total) == (1, 0, 0)
    ctl.handle_lease(("live", b""), P.LeaseRequest(2, "train", 1, 1, 300.0), [])
    reply = replies.last("live")
    assert reply.lease_id and [g.meta.group_id for g in reply.groups] == ["a"]


def test_a_reply_to_an_unknown_peer_is_reported_undelivered():
    from slipstream.queue.server import QueueServer

    srv = QueueServer(QueueConfig(shm_bytes_per_unit=0))  # never served: this thread may use its sockets
    try:
        assert srv._send((srv._socket, b"nobody"), P.MsgType.OK, P.DoneReply(1)) is False
    finally:
        srv.stop()


def test_a_lease_waiter_whose_connection_closed_is_granted_nothing(server):
    srv = server(lease_timeout_s=600)
    client = QueueClient(srv.address, timeout_s=30)
    client.ping()
    if client.transport != "unix":
        pytest.skip("the direct channel needs Linux abstract sockets")
    from slipstream.queue.direct import abstract_address

    body = b"".join(Codec().encode(P.MsgType.LEASE, P.LeaseRequest(1, "train", 1, 1, 300.0)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.connect(abstract_address(client._session.direct))
        gone.sendall(struct.pack("<I", len(body)) + body)
        _wait(lambda: client.stats().leases_waiting == 1, "the lease never started waiting")
    _wait(lambda: client.stats().leases_waiting == 0, "the server kept the waiter of a closed connection")
    assert client.put(make_group("a"))
    lease = client.lease(1, timeout_s=5)  # not held by the closed connection for lease_timeout_s
    assert lease is not None and [g.group_id for g in lease.groups] == ["a"]
    client.ack(lease)
    client.close()


def _raw(address: str, msg_type: P.MsgType, header) -> object:
    """One request from a bare socket, as another program would send it (it has no client's secret)."""
    codec, ctx = Codec(), zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send_multipart(codec.encode(msg_type, header))
        assert sock.poll(10_000), "no reply"
        return codec.decode_reply(sock.recv_multipart(), msg_type)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_lease_is_usable_only_by_the_client_it_was_granted_to(server):
    srv = server(lease_timeout_s=600)
    holder = QueueClient(srv.address, timeout_s=30, shared_memory=False)
    other = QueueClient(srv.address, timeout_s=30)
    for i in range(3):
        holder.put(make_group(f"g{i}", payload=100))  # stored as frames: a lease of them needs a fetch
    first, second = holder.lease(1, timeout_s=5), holder.lease(1, timeout_s=5)
    assert len(first.lease_id) >= 22 and first.lease_id[:8] != second.lease_id[:8]  # random, no counter
    for call in (other.ack, other.nack):
        with pytest.raises(QueueError, match="unknown_lease"):  # even knowing the id
            call(first.lease_id)
    token = srv.controller.ledger.groups["g0"].token
    unit = f"tcp://127.0.0.1:{srv.units[srv.controller.ledger.groups['g0'].unit].port}"
    fetched = _raw(unit, P.MsgType.FETCH, P.FetchRequest(1, first.lease_id, [token]))
    assert isinstance(fetched, P.ErrorReply) and fetched.kind == "unknown_lease"
    quarantined = _raw(srv.address, P.MsgType.QUARANTINE, P.QuarantineRequest(1, first.lease_id, ["g0"]))
    assert isinstance(quarantined, P.ErrorReply) and quarantined.kind == "unknown_lease"
    assert holder.stats().partitions["train"].leased_groups == 2
    holder.ack(first)
    holder.nack(second)
    assert [g.group_id for g in other.lease(2, timeout_s=5).groups] == ["g1", "g2"]
    holder.close()
    other.close()


def test_an_arena_credit_is_usable_only_by_its_producer(server):
    srv = server(shm_min_group_bytes=0)
    producer = QueueClient(srv.address, timeout_s=30)
    assert producer.put(make_group("a", payload=100))  # the reply brings a credit for the next put
    if not producer._session.credits:
        pytest.skip("no shared memory here")
    token = producer._session.credits[0][0].token
    released = _raw(srv.address, P.MsgType.RESERVE, P.ReserveRequest(1, 0, [token]))
    assert isinstance(released, P.ReserveReply)  # nothing of another's to release: silently nothing
    group = make_group("b", payload=100)
    from slipstream.queue.codec import layout_region

    specs, _ = layout_region(group.tensors, 0)
    stolen = _raw(srv.address, P.MsgType.COMMIT, P.CommitRequest(2, token, "train", group.meta, specs, 1.0))
    assert isinstance(stolen, P.ErrorReply) and stolen.kind == "expired"
    assert producer.stats().credits == 1
    assert producer.put(group)  # into the credit it still holds
    lease = producer.lease(2, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["a", "b"]
    producer.ack(lease)
    producer.close()


def test_an_expired_lease_can_still_fetch_and_ack_what_was_not_leased_again(server):
    srv = server(lease_timeout_s=0.3, shared_memory=False)  # groups stored as frames: leases need a fetch
    watcher = QueueClient(srv.address, timeout_s=30)
    watcher.put(make_group("a", payload=100))
    owner = b"k" * 16
    granted = _raw(srv.address, P.MsgType.LEASE, P.LeaseRequest(1, "train", 1, 1, 5.0, owner=owner))
    _wait(lambda: watcher.stats().partitions["train"].expired_total == 1, "the lease never expired")
    group = granted.groups[0]
    unit = f"tcp://127.0.0.1:{srv.units[group.unit].port}"
    fetched = _raw(unit, P.MsgType.FETCH, P.FetchRequest(2, granted.lease_id, [group.token], owner=owner))
    assert isinstance(fetched, P.FetchReply) and fetched.counts == [group.num_buffers]
    acked = _raw(srv.address, P.MsgType.ACK, P.AckRequest(3, granted.lease_id, owner=owner))
    assert isinstance(acked, P.AckReply) and (acked.acked, acked.lost) == (1, 0)
    assert watcher.lease(1, timeout_s=0.2) is None  # consumed, not delivered again
    watcher.close()


def test_a_client_given_the_owner_secret_of_a_dead_one_can_hand_its_leases_back(server):
    srv = server(lease_timeout_s=600)
    secret = b"s" * 16
    dead = QueueClient(srv.address, timeout_s=30, owner=secret)
    dead.put(make_group("a"))
    held = dead.lease(1, timeout_s=5)  # then the process "dies" without closing its client
    successor = QueueClient(srv.address, timeout_s=30, owner=secret)  # e.g. a restarted trainer rank 0
    successor.nack(held.lease_id)
    assert [g.group_id for g in successor.lease(1, timeout_s=5).groups] == ["a"]
    successor.close()
    with pytest.raises(ValueError, match="16 random bytes"):
        QueueClient(srv.address, owner=b"short")
