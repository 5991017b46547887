"""Out-of-range numbers in requests are refused by name (queue/checks.py), over real sockets, and the
connection that sent them goes on being served."""

from __future__ import annotations

import math

import pytest
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.client import QueueClient, QueueError
from slipstream.queue.codec import Codec
from slipstream.queue.testing import make_group

CAPACITY_GROUPS = 64
CAPACITY_BYTES = 1 << 30
HUGE = 2**62


@pytest.fixture
def srv(server):
    return server(capacity_groups=CAPACITY_GROUPS, capacity_bytes=CAPACITY_BYTES)


class Raw:
    """A bare DEALER socket, as a hostile program would connect; replies decoded by type."""

    def __init__(self, address: str) -> None:
        self.codec, self.ctx = Codec(), zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)

    def ask(self, msg_type: P.MsgType, header, frames=()) -> object:
        self.sock.send_multipart([*self.codec.encode(msg_type, header), *frames])
        assert self.sock.poll(10_000), "no reply"
        return self.codec.decode_reply(self.sock.recv_multipart(), msg_type)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _refused(reply, message: str) -> None:
    assert isinstance(reply, P.ErrorReply), reply
    assert (reply.kind, reply.message) == ("bad_request", message)


_GROUPS = "(queue.capacity_groups, the most groups the queue holds), got {}"


def _bytes(what: str, nbytes: int) -> str:
    if nbytes < 0:
        return f"{what} must be at least 0, got {nbytes}"
    return (
        f"{what}={nbytes} is more than capacity_bytes={CAPACITY_BYTES}: a group that large could never be "
        "admitted; raise queue.capacity_bytes"
    )


LEASES = [
    ((HUGE, 1, 1.0), f"LEASE n_groups must be from 1 to {CAPACITY_GROUPS} " + _GROUPS.format(HUGE)),
    ((0, 0, 1.0), f"LEASE n_groups must be from 1 to {CAPACITY_GROUPS} " + _GROUPS.format(0)),
    ((4, HUGE, 1.0), f"LEASE min_groups must be from 1 to {CAPACITY_GROUPS} " + _GROUPS.format(HUGE)),
    ((2, 3, 1.0), "LEASE min_groups (3) must not exceed n_groups (2)"),
    ((1, 1, math.nan), "LEASE timeout_s must be a finite number of seconds >= 0, got nan"),
    ((1, 1, -math.inf), "LEASE timeout_s must be a finite number of seconds >= 0, got -inf"),
    ((1, 1, math.inf), "LEASE timeout_s must be a finite number of seconds >= 0, got inf"),
    ((1, 1, -1.0), "LEASE timeout_s must be a finite number of seconds >= 0, got -1.0"),
]


@pytest.mark.parametrize(("args", "message"), LEASES)
def test_a_lease_out_of_range_is_refused_by_name(srv, args, message):
    raw = Raw(srv.address)
    try:
        _refused(raw.ask(P.MsgType.LEASE, P.LeaseRequest(1, "train", *args)), message)
        assert isinstance(raw.ask(P.MsgType.PING, P.PingRequest(2)), P.DoneReply)  # still served
    finally:
        raw.close()
    with QueueClient(srv.address, timeout_s=30) as client:
        assert client.stats().leases_waiting == 0


@pytest.mark.parametrize("nbytes", [HUGE, -1])
def test_a_reservation_out_of_range_is_refused_by_name(srv, nbytes):
    raw = Raw(srv.address)
    try:
        reply = raw.ask(P.MsgType.RESERVE, P.ReserveRequest(1, nbytes))
        _refused(reply, _bytes("RESERVE nbytes", nbytes))
        granted = raw.ask(P.MsgType.RESERVE, P.ReserveRequest(2, 4096))
        assert isinstance(granted, P.ReserveReply) and granted.credit is not None
        assert granted.credit.nbytes == 4096
    finally:
        raw.close()


def test_a_commit_out_of_range_is_refused_by_name(srv):
    group = make_group("c")
    raw = Raw(srv.address)
    try:
        nan_wait = P.CommitRequest(1, 0, "train", group.meta, [], math.nan)
        _refused(
            raw.ask(P.MsgType.COMMIT, nan_wait),
            "COMMIT timeout_s must be a finite number of seconds >= 0, got nan",
        )
        huge_next = P.CommitRequest(2, 0, "train", group.meta, [], 1.0, HUGE)
        _refused(
            raw.ask(P.MsgType.COMMIT, huge_next),
            _bytes("COMMIT next_nbytes", HUGE),
        )
    finally:
        raw.close()


def test_a_put_waiting_nan_seconds_is_refused_by_name(srv):
    group = make_group("p")
    raw = Raw(f"tcp://127.0.0.1:{srv.units[0].port}")
    try:
        reply = raw.ask(P.MsgType.PUT, P.PutRequest(1, "train", group.meta, [], math.nan))
        _refused(reply, "PUT timeout_s must be a finite number of seconds >= 0, got nan")
    finally:
        raw.close()


def test_the_client_raises_the_servers_reason(srv):
    with QueueClient(srv.address, timeout_s=30) as client:
        with pytest.raises(
            QueueError, match=f"bad_request: LEASE n_groups must be from 1 to {CAPACITY_GROUPS}"
        ):
            client.lease(HUGE, timeout_s=0)
        assert client.put(make_group("ok"))  # the same client goes on
        lease = client.lease(1, timeout_s=5)
        assert lease is not None and [g.group_id for g in lease.groups] == ["ok"]
        client.ack(lease)
