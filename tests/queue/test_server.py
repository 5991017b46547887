"""Queue semantics against a live server in this process: FIFO, dedup, leases, partitions, stats."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from slipstream.queue.client import AsyncQueueClient, QueueClient, QueueError, QueueFull, QueueStats
from slipstream.queue.testing import make_group


@pytest.fixture
def client_of():
    clients = []

    def make(srv, **kw) -> QueueClient:
        c = QueueClient(srv.address, timeout_s=30, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def _ids(lease):
    return [g.group_id for g in lease.groups]


def _arena_freed(client) -> QueueStats:
    """Stats once no arena byte is held: every acked group's journal copy is written and every zero-copy
    send of an arena region is done (until then the region stays pinned)."""
    deadline = time.monotonic() + 30
    while (stats := client.stats()).journal_backlog_groups or stats.shm_bytes_used:
        assert time.monotonic() < deadline, f"arena bytes still held: {stats}"
        time.sleep(0.02)
    return stats


@pytest.mark.parametrize(("producer_shm", "consumer_shm"), [(True, True), (True, False), (False, True)])
def test_put_lease_ack_fifo_and_payload_intact(server, client_of, producer_shm, consumer_shm):
    srv = server(shm_min_group_bytes=1024, journal=True)
    producer = client_of(srv, shared_memory=producer_shm)
    consumer = client_of(srv, shared_memory=consumer_shm)
    # all-inline groups, small arena puts, a group of several frame-sized tensors (aligned offsets leave
    # gaps between them), and a large one (a zero-copy, pinned send to a socket consumer)
    groups = [make_group(f"g{i}", payload=p) for i, p in enumerate([0, 200, 0, 10_000, 0])]
    groups[2] = make_group("g2", n=8, response_len=101, payload=3)
    assert all(producer.put(g) for g in groups)
    lease = consumer.lease(3, timeout_s=5)
    assert _ids(lease) == ["g0", "g1", "g2"] and lease.deadline > time.time()
    rest = consumer.lease(2, timeout_s=5)
    assert _ids(rest) == ["g3", "g4"]
    for got, sent in zip(lease.groups + rest.groups, groups, strict=True):
        assert got.meta == sent.meta
        assert set(got.tensors) == set(sent.tensors)
        for name, t in sent.tensors.items():
            assert torch.equal(got.tensors[name], t), name
    consumer.ack(lease)
    consumer.ack(rest)
    assert consumer.lease(1, timeout_s=0.2) is None
    stats = consumer.stats()
    assert stats.held_groups == 0 and stats.partitions["train"].acked_total == 5
    assert stats.credits == (1 if producer_shm else 0)  # the producer's credit for its next put
    producer.close()  # hands the credit back
    _arena_freed(consumer)


def test_duplicates_are_dropped_before_and_after_ack(server, client_of):
    c = client_of(server())
    assert c.put(make_group("a")) is True
    assert c.put(make_group("a")) is False  # same group id while ready
    clash = make_group("b")
    clash.meta.samples[0].uid = "a-0"  # a uid already held
    assert c.put(clash) is False
    lease = c.lease(1, timeout_s=5)
    assert c.put(make_group("a")) is False  # while leased
    c.ack(lease)
    assert c.put(make_group("a")) is False  # after ack: consumed for good
    assert c.lease(1, timeout_s=0.1) is None
    assert c.stats().duplicates_total == 4


def test_nack_and_expiry_return_groups_to_the_front_in_order(server, client_of):
    srv = server(lease_timeout_s=0.5)
    c = client_of(srv)
    for i in range(4):
        c.put(make_group(f"g{i}"))
    first = c.lease(2, timeout_s=5)
    second = c.lease(1, timeout_s=5)
    assert _ids(second) == ["g2"]  # left to expire
    c.nack(first)
    again = c.lease(3, timeout_s=5)
    assert _ids(again) == ["g0", "g1", "g3"]
    deadline = time.monotonic() + 10
    while c.stats().partitions["train"].expired_total < 4 and time.monotonic() < deadline:
        time.sleep(0.1)  # both leases time out (0.5 s)
    back = c.lease(4, timeout_s=5)
    assert _ids(back) == ["g0", "g1", "g2", "g3"]
    c.ack(back)
    with pytest.raises(QueueError, match="unknown_lease"):
        c.ack("no-such-lease")


async def _until(predicate, what: str) -> None:
    """Let the event loop run until ``predicate()`` holds."""
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _expired(client, n: int) -> None:
    """Wait until the server has expired ``n`` leased groups in all."""
    deadline = time.monotonic() + 30
    while client.stats().partitions["train"].expired_total < n:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.02)


def test_late_ack_consumes_what_was_not_handed_out_again(server, client_of):
    srv = server(lease_timeout_s=0.3)
    c = client_of(srv)
    c.put(make_group("a"))
    c.put(make_group("b"))
    lease = c.lease(2, timeout_s=5)
    _expired(c, 2)
    other = c.lease(1, timeout_s=5)  # "a" goes to a second holder after the expiry
    assert _ids(other) == ["a"]
    c.ack(lease)  # late: consumes "b", reports "a" as already handed out
    c.ack(other)
    assert c.lease(1, timeout_s=0.1) is None
    assert c.stats().partitions["train"].acked_total == 2


def test_a_late_ack_is_fenced_by_the_groups_last_lease(server, client_of):
    srv = server(lease_timeout_s=0.3, shared_memory=False)  # stored as frames: the lease needs a fetch
    first, second = client_of(srv), client_of(srv)
    first.put(make_group("a", payload=100))
    first.put(make_group("b", payload=100))
    lease = first.lease(2, timeout_s=5)
    _expired(first, 2)
    again = second.lease(1, timeout_s=5)  # "a" is leased again ...
    second.nack(again)  # ... and handed back: ready, but no longer the first lease's
    first.ack(lease)  # late: "b" had not been leased again, so it is consumed; "a" is not
    stats = first.stats().partitions["train"]
    assert (stats.acked_total, stats.ready_groups) == (1, 1)
    assert _ids(second.lease(2, min_groups=1, timeout_s=5)) == ["a"]


@pytest.mark.parametrize("ipc", [True, False])
def test_lease_waits_for_min_groups_and_is_woken_by_a_put(server, client_of, ipc):
    srv = server()
    consumer, producer = client_of(srv), client_of(srv)

    async def scenario():
        aconsumer = AsyncQueueClient(srv.address, timeout_s=30, ipc=ipc)
        try:
            waiting = asyncio.ensure_future(aconsumer.lease(3, min_groups=2, timeout_s=20))
            await _until(lambda: consumer.stats().leases_waiting == 1, "the lease never started waiting")
            producer.put(make_group("a"))
            assert consumer.stats().leases_waiting == 1  # one ready, two needed
            assert not waiting.done()
            producer.put(make_group("b"))
            lease = await asyncio.wait_for(waiting, 20)
            assert _ids(lease) == ["a", "b"]
            await aconsumer.ack(lease)
        finally:
            await aconsumer.close()

    asyncio.run(scenario())
    assert consumer.lease(1, timeout_s=0.05) is None
    with pytest.raises(QueueError, match="min_groups"):
        consumer.lease(2, min_groups=3, timeout_s=0)


def test_partitions_are_independent(server, client_of):
    c = client_of(server())
    c.put(make_group("t1"))
    c.put(make_group("v1"), partition="val")
    c.put(make_group("t2"))
    assert _ids(c.lease(5, partition="val", min_groups=1, timeout_s=5)) == ["v1"]
    assert _ids(c.lease(5, min_groups=1, timeout_s=5)) == ["t1", "t2"]
    parts = c.stats().partitions
    assert parts["val"].leased_groups == 1 and parts["train"].leased_groups == 2
    with pytest.raises(QueueError, match="partition"):
        c.put(make_group("x"), partition="bad name!")


def test_dropped_groups_are_kept_for_regeneration(server, client_of):
    c = client_of(server())
    for i in range(3):
        c.put(make_group(f"g{i}"))
    lease = c.lease(3, timeout_s=5)
    with pytest.raises(QueueError, match="not in lease"):
        c.ack(lease, dropped=["zzz"])
    c.ack(lease, dropped=["g0", "g2"])
    dropped = c.pop_dropped()
    assert [m.group_id for m in dropped] == ["g0", "g2"] and dropped[0].samples[0].uid == "g0-0"
    assert c.pop_dropped() == []
    assert c.put(make_group("g0")) is False  # consumed without training still counts as consumed
    assert c.stats().partitions["train"].dropped_total == 2


def test_stats_depth_rates_and_staleness_histogram(server, client_of):
    c = client_of(server())
    for i, version in enumerate([5, 5, 3, 7]):
        c.put(make_group(f"g{i}", version=version, payload=10))
    lease = c.lease(3, timeout_s=5, consumer_version=7)  # staleness 2, 2, 4
    stats = c.stats()
    part = stats.partitions["train"]
    assert (part.ready_groups, part.leased_groups) == (1, 3)
    assert part.ready_bytes + part.leased_bytes == stats.held_bytes > 0
    assert part.put_total == 4 and part.leased_total == 3 and part.put_rate > 0
    assert part.staleness == {2: 2, 4: 1}
    c.ack(lease)
    c.lease(1, timeout_s=5, consumer_version=9)  # version 7 -> staleness 2
    assert c.stats().staleness() == {2: 3, 4: 1}


def test_back_pressure_waits_then_fails_with_a_clear_message(server, client_of):
    srv = server(capacity_groups=2)
    producer, consumer = client_of(srv), client_of(srv)
    assert producer.put(make_group("a")) and producer.put(make_group("b"))
    with pytest.raises(QueueFull, match=r"queue full for 0.3s: holding 2/2 groups"):
        producer.put(make_group("c"), timeout_s=0.3)

    async def scenario():
        aproducer = AsyncQueueClient(srv.address, timeout_s=30)
        try:
            waiting = asyncio.ensure_future(aproducer.put(make_group("c"), timeout_s=20))
            await _until(lambda: consumer.stats().puts_waiting == 1, "the put never started waiting")
            assert not waiting.done()
            consumer.ack(consumer.lease(1, timeout_s=5))  # room for one
            assert await asyncio.wait_for(waiting, 20) is True
        finally:
            await aproducer.close()

    asyncio.run(scenario())
    assert [g.group_id for g in consumer.lease(2, timeout_s=5).groups] == ["b", "c"]


def test_byte_capacity_and_oversized_groups(server, client_of):
    srv = server(capacity_bytes=20_000)
    c = client_of(srv)
    with pytest.raises(QueueError, match="more than capacity_bytes=20000"):
        c.put(make_group("huge", payload=5000))
    assert c.put(make_group("a", payload=1500))  # 12 kB
    with pytest.raises(QueueFull, match="bytes"):
        c.put(make_group("b", payload=1500), timeout_s=0.2)


def test_full_arena_falls_back_to_the_socket(server, client_of):
    srv = server(shm_bytes_per_unit=64 * 1024, num_storage_units=1, shm_min_group_bytes=0, journal=True)
    c = client_of(srv)
    groups = [make_group(f"g{i}", payload=4000) for i in range(3)]  # 32 kB each: the third does not fit
    assert all(c.put(g) for g in groups)
    assert c.stats().shm_bytes_used > 0
    lease = c.lease(3, timeout_s=5)
    for got, sent in zip(lease.groups, groups, strict=True):
        assert torch.equal(got.tensors["payload"], sent.tensors["payload"])
    c.ack(lease)
    _arena_freed(c)


def test_close_gives_held_leases_back(server, client_of):
    srv = server()
    holder, other = QueueClient(srv.address), client_of(srv)
    other.put(make_group("a"))
    assert holder.lease(1, timeout_s=5) is not None
    holder.close()
    assert _ids(other.lease(1, timeout_s=5)) == ["a"]
    with pytest.raises(QueueError, match="closed"):
        holder.stats()


def test_no_server_is_a_clear_timeout():
    from slipstream.utils.net import free_port

    c = QueueClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)
    with pytest.raises(QueueError, match="no reply from the queue server"):
        c.stats()
    c.close()
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        QueueClient("localhost:5555")


def test_an_unused_arena_credit_lapses_and_cannot_be_committed_late(server, client_of):
    import zmq

    from slipstream.queue import codec as C
    from slipstream.queue import protocol as P

    srv = server(reserve_timeout_s=0.3, shm_min_group_bytes=0)
    c = client_of(srv)
    codec = C.Codec()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(srv.address)
    sock.send_multipart(codec.encode(P.MsgType.RESERVE, P.ReserveRequest(1, 4096)))
    assert sock.poll(10_000)
    credit = codec.decode_reply(sock.recv_multipart(), P.MsgType.RESERVE).credit
    assert credit is not None and c.stats().credits == 1 and c.stats().shm_bytes_used == 4096
    deadline = time.monotonic() + 10
    while c.stats().credits:  # the writer "died": the credit lapses and its region is freed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.stats().shm_bytes_used == 0
    group = make_group("a", payload=64)
    specs, _ = C.layout_region(group.tensors, 0)
    sock.send_multipart(
        codec.encode(P.MsgType.COMMIT, P.CommitRequest(2, credit.token, "train", group.meta, specs, 1.0))
    )
    assert sock.poll(10_000)
    late = codec.decode_reply(sock.recv_multipart(), P.MsgType.COMMIT)
    assert isinstance(late, P.ErrorReply) and late.kind == "expired"
    sock.close()
    ctx.term()
    assert c.put(group) is True  # never stored, so not seen


def test_credits_make_later_arena_puts_one_round_trip_and_survive_duplicates(server, client_of):
    srv = server(shm_min_group_bytes=0)
    c = client_of(srv)
    assert c.put(make_group("a", payload=100))  # reserve + commit, and a credit for the next put
    assert c.stats().credits == 1
    assert c.put(make_group("a", payload=100)) is False  # duplicate: the credit comes back unused
    assert c.stats().credits == 1
    assert c.put(make_group("b", payload=100))  # written into the credit
    lease = c.lease(2, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["a", "b"]
    assert torch.equal(lease.groups[1].tensors["payload"], make_group("b", payload=100).tensors["payload"])
    c.ack(lease)


def test_a_refused_arena_put_gives_its_credit_back(server, client_of):
    c = client_of(server(shm_min_group_bytes=0))
    assert c.put(make_group("a", payload=100))
    with pytest.raises(QueueError, match="partition"):
        c.put(make_group("b", payload=100), partition="bad name!")
    assert c.stats().credits == 1  # handed back by the server, no longer used by the client
    assert c.put(make_group("c", payload=100))  # reserves afresh and releases the old credit with it
    assert c.stats().credits == 1
    lease = c.lease(5, min_groups=1, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["a", "c"]
    c.ack(lease)


def test_same_host_clients_move_to_unix_domain_sockets_and_tcp_still_serves(server, client_of):
    from slipstream.queue.codec import ipc_supported

    srv = server(shm_min_group_bytes=0)
    local, tcp = client_of(srv), client_of(srv, ipc=False)
    assert local.put(make_group("a", payload=100)) and tcp.put(make_group("b", payload=100))
    assert local.transport == ("unix" if ipc_supported() else "tcp") and tcp.transport == "tcp"
    lease = tcp.lease(2, timeout_s=5)
    assert _ids(lease) == ["a", "b"]
    tcp.ack(lease)
    no_ipc = client_of(server(ipc=False))
    no_ipc.ping()
    assert no_ipc.transport == "tcp"


def _fill(group, payload):
    n_prompt = group.tensors["prompt_ids"].numel()
    for name in ("prompt_ids", "response_ids", "versions"):
        group.tensors[name].copy_(torch.arange(group.tensors[name].numel(), dtype=torch.int32))
    group.tensors["loss_mask"].fill_(1)
    group.tensors["logprobs"].fill_(-0.5)
    group.tensors["payload"].copy_(payload)
    return n_prompt


def test_an_allocated_group_is_put_where_it_lies(server, client_of):
    from slipstream.queue.types import GroupMeta, SampleMeta

    srv = server(shm_min_group_bytes=0)
    producer, consumer = client_of(srv), client_of(srv)
    meta = GroupMeta("a", [SampleMeta("a-0", 3, 5, 0, 0), SampleMeta("a-1", 2, 5, 0, 0)])
    group = producer.alloc_group(meta, {"payload": ((10, 1000), torch.uint8)})
    assert group.placement is not None
    payload = (torch.arange(10_000) % 251).to(torch.uint8).reshape(10, 1000)
    _fill(group, payload)
    assert producer.put(group) is True and group.placement is None
    lease = consumer.lease(1, timeout_s=5)
    got = lease.groups[0]
    assert got.meta == meta and torch.equal(got.tensors["payload"], payload)
    assert torch.equal(got.tensors["response_ids"], torch.arange(10, dtype=torch.int32))
    group.tensors["payload"][0, 0] = 7  # (never do this) the consumer sees it: the put copied nothing
    assert int(got.tensors["payload"][0, 0]) == 7
    consumer.ack(lease)

    # a tensor the producer replaced is copied into its slot; a reshaped one makes it an ordinary put
    for gid, replacement in (
        ("b", torch.full((10, 1000), 3, dtype=torch.uint8)),
        ("c", torch.ones(10, 7, dtype=torch.uint8)),
    ):
        meta = GroupMeta(gid, [SampleMeta(f"{gid}-0", 3, 10, 0, 0)])
        group = producer.alloc_group(meta, {"payload": ((10, 1000), torch.uint8)})
        _fill(group, payload)
        group.tensors["payload"] = replacement
        assert producer.put(group) is True
        lease = consumer.lease(1, timeout_s=5)
        assert torch.equal(lease.groups[0].tensors["payload"], replacement)
        consumer.ack(lease)


def test_an_allocated_group_without_shared_memory_or_put_too_late(server, client_of):
    from slipstream.queue.types import GroupMeta, SampleMeta

    srv = server(shm_min_group_bytes=0)
    remote, local = client_of(srv, shared_memory=False), client_of(srv)
    meta = GroupMeta("r", [SampleMeta("r-0", 2, 3, 0, 0)])
    group = remote.alloc_group(meta, {"payload": ((3, 100), torch.uint8)})
    assert group.placement is None  # plain tensors: the put copies as usual
    _fill(group, torch.ones(3, 100, dtype=torch.uint8))
    assert remote.put(group) is True
    late = local.alloc_group(
        GroupMeta("late", [SampleMeta("late-0", 2, 3, 0, 0)]), {"payload": ((3, 100), torch.uint8)}
    )
    _fill(late, torch.ones(3, 100, dtype=torch.uint8))
    late.placement.usable_until = 0.0  # as if the producer took too long
    with pytest.raises(QueueError, match="allocated group must be put within"):
        local.put(late)
    with pytest.raises(ValueError, match="standard column"):
        local.alloc_group(meta, {"logprobs": ((3,), torch.float32)})
    assert _ids(local.lease(2, min_groups=1, timeout_s=5)) == ["r"]


def test_a_server_gone_fails_direct_channel_requests_at_once(server):
    srv = server()
    client = QueueClient(srv.address, timeout_s=30)
    client.ping()
    srv.stop()
    started = time.monotonic()
    with pytest.raises(QueueError, match="direct channel to the queue server|no reply"):
        client.ping()
    assert client.transport == "tcp" or time.monotonic() - started < 20  # not the 30 s timeout
    client.close()


def test_a_header_nested_too_deeply_is_a_bad_request_logged_in_one_line(server, client_of, caplog):
    """msgspec refuses deep nesting with a RecursionError: it is the sender's malformed input (bad_request
    and one log line), not an internal error with a traceback per request."""
    import logging

    import msgspec
    import zmq

    from slipstream.queue import codec as C
    from slipstream.queue import protocol as P
    from slipstream.queue.types import SampleMeta

    srv = server()
    codec = C.Codec()
    group = make_group("deep")
    specs, frames = [], []
    for name, t in group.tensors.items():
        specs.append(P.TensorSpec(name, C.DTYPE_NAMES[t.dtype], list(t.shape), frame=len(frames)))
        frames.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    type_byte, header = codec.encode(P.MsgType.PUT, P.PutRequest(7, "train", group.meta, specs, 1.0))
    # Nesting under a key of the first sample's outcome map that this server does not know (a newer
    # sender's field): the decoder skips its value, but still walks it.
    raw = msgspec.msgpack.decode(header)
    sample = raw[P.PutRequest.__struct_fields__.index("meta")][1][0]
    sample[SampleMeta.__struct_fields__.index("outcome")] = {"x": "NESTED-HERE"}
    header = msgspec.msgpack.encode(raw)
    marker = msgspec_str(b"NESTED-HERE")
    assert header.count(marker) == 1
    header = header.replace(marker, b"\x91" * 6000 + b"\xc0")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{srv.units[0].port}")
    try:
        with caplog.at_level(logging.WARNING, logger="slipstream.queue.server"):
            for _ in range(3):
                sock.send_multipart([type_byte, header, *frames])
                assert sock.poll(10_000)
                reply = codec.decode_reply(sock.recv_multipart(), P.MsgType.PUT)
                assert isinstance(reply, P.ErrorReply) and reply.kind == "bad_request", reply
                assert reply.req_id == 7 and "nested too deeply" in reply.message
    finally:
        sock.close()
        ctx.term()
    records = [
        r for r in caplog.records if r.name == "slipstream.queue.server" and r.levelno >= logging.WARNING
    ]
    assert len(records) == 3 and not any(r.exc_info for r in records)
    assert all("\n" not in r.getMessage() for r in records)
    assert client_of(srv).put(make_group("after")) is True  # still serving


def msgspec_str(raw: bytes) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(raw.decode())
