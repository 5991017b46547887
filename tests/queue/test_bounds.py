"""Memory stays bounded whatever a client does: a direct-channel client that never reads its replies stops
being read, parked puts and waiting leases are capped with clear errors, and ZeroMQ queues have limits."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.client import QueueClient, QueueError, QueueFull
from slipstream.queue.codec import Codec
from slipstream.queue.config import QueueConfig
from slipstream.queue.testing import make_group


def _wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _framed(msg_type: P.MsgType, header) -> bytes:
    body = b"".join(Codec().encode(msg_type, header))
    return struct.pack("<I", len(body)) + body


@pytest.fixture
def idle_server():
    """A server that is never started: the test drives its loop's steps itself, on this thread."""
    from slipstream.queue.server import QueueServer

    srv = QueueServer(QueueConfig(shm_bytes_per_unit=0, direct_max_unread_bytes=64 * 1024, zmq_hwm=500))
    yield srv
    srv.stop()


def test_a_direct_client_that_never_reads_stops_being_read(idle_server):
    from slipstream.queue.direct import _FILL_MAX, DirectConn

    srv = idle_server
    client, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = DirectConn(server_end, 1 << 20)
    srv._conns[conn.fd] = conn
    srv._poller.register(conn.fd, zmq.POLLIN)
    batch = _framed(P.MsgType.STATS, P.StatsRequest(1)) * 1000
    client.setblocking(False)
    sent = 0
    while True:  # write requests, never read a reply, until the server stops taking them
        try:
            client.send(batch)
        except BlockingIOError:
            break
        sent += 1000
        assert sent < 200_000, "the server kept reading a client that never reads its replies"
        srv._serve_conn(conn, zmq.POLLIN)
    for _ in range(3):
        srv._serve_conn(conn, zmq.POLLIN | zmq.POLLOUT)
    assert conn.unread_bytes <= 64 * 1024 + 4096
    assert len(conn._reader.buf) <= _FILL_MAX + 64 * 1024
    client.close()


def test_zmq_queues_have_high_water_marks(idle_server):
    for sock in idle_server._routes:
        assert sock.getsockopt(zmq.SNDHWM) == 500 and sock.getsockopt(zmq.RCVHWM) == 500


def test_a_client_that_reads_late_still_gets_every_reply_in_order(server):
    srv = server(direct_max_unread_bytes=4096)
    probe = QueueClient(srv.address, timeout_s=30)
    probe.ping()
    if probe.transport != "unix":
        pytest.skip("the direct channel needs Linux abstract sockets")
    from slipstream.queue.direct import abstract_address

    n = 20_000
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(abstract_address(probe._session.direct))
        requests = b"".join(_framed(P.MsgType.PING, P.PingRequest(i)) for i in range(1, n + 1))
        sender = threading.Thread(target=sock.sendall, args=(requests,))
        sender.start()  # blocks once the server stops reading, until the replies below are read
        reader, codec = sock.makefile("rb"), Codec()
        for i in range(1, n + 1):
            (length,) = struct.unpack("<I", reader.read(4))
            assert codec.req_id(reader.read(length)[1:]) == i
        sender.join(30)
    probe.close()


def _put_in_background(address: str, group, results: list) -> threading.Thread:
    def put() -> None:
        with QueueClient(address, timeout_s=60, shared_memory=False) as producer:
            results.append(producer.put(group, timeout_s=60))

    thread = threading.Thread(target=put)
    thread.start()
    return thread


def _drain(client: QueueClient, threads: list[threading.Thread]) -> None:
    while any(t.is_alive() for t in threads):
        lease = client.lease(1, timeout_s=5)
        if lease is not None:
            client.ack(lease)
    for thread in threads:
        thread.join()


def test_parked_puts_are_bounded_in_number(server):
    srv = server(capacity_groups=1, max_parked_puts=2)
    c = QueueClient(srv.address, timeout_s=30, shared_memory=False)
    assert c.put(make_group("a"))
    results: list = []
    threads = [_put_in_background(srv.address, make_group(f"p{i}"), results) for i in range(2)]
    _wait(lambda: c.stats().puts_waiting == 2, "the puts never parked")
    started = time.monotonic()
    try:
        with pytest.raises(QueueFull, match=r"2 put\(s\) holding \d+ bytes already wait for room"):
            c.put(make_group("refused"), timeout_s=20)
        assert time.monotonic() - started < 10  # at once, not after its timeout
    finally:
        _drain(c, threads)
    assert results == [True, True] and c.stats().puts_waiting == 0
    c.close()


def test_parked_puts_are_bounded_in_payload_bytes(server):
    srv = server(capacity_groups=1, max_parked_put_bytes=100_000)
    c = QueueClient(srv.address, timeout_s=30, shared_memory=False)  # puts carry their payload as frames
    assert c.put(make_group("a"))
    results: list = []
    threads = [_put_in_background(srv.address, make_group("p0", payload=7000), results)]  # 56 kB of frames
    _wait(lambda: c.stats().puts_waiting == 1, "the put never parked")
    assert c.stats().puts_waiting_bytes >= 56_000  # the accounting sees what parked puts hold
    try:
        with pytest.raises(QueueFull, match="max_parked_put_bytes=100000"):
            c.put(make_group("p1", payload=7000), timeout_s=20)
    finally:
        _drain(c, threads)
    assert results == [True] and c.stats().puts_waiting_bytes == 0
    c.close()


def test_waiting_leases_are_bounded(server):
    srv = server(max_waiting_leases=2)
    c = QueueClient(srv.address, timeout_s=30)
    got: list = []

    def wait_for_one() -> None:
        with QueueClient(srv.address, timeout_s=30) as consumer:
            lease = consumer.lease(1, timeout_s=60)
            got.append([g.group_id for g in lease.groups])
            consumer.ack(lease)

    waiters = [threading.Thread(target=wait_for_one) for _ in range(2)]
    for w in waiters:
        w.start()
    try:
        _wait(lambda: c.stats().leases_waiting == 2, "the leases never waited")
        with pytest.raises(QueueError, match="too_many_waiting"):
            c.lease(1, timeout_s=20)
    finally:
        c.put(make_group("a"))
        c.put(make_group("b"))
        for w in waiters:
            w.join(30)
    assert sorted(got) == [["a"], ["b"]]
    c.close()
