"""The queue's promises across real processes: a killed consumer loses nothing, duplicates from separate
producers are stored once, back-pressure holds, snapshots survive a server restart, and no input kills it."""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.client import QueueClient, QueueError
from slipstream.queue.testing import make_group

# A producer process: puts the groups named on the command line (`gid` or `gid@timeout_s`), one result line
# per put.
PRODUCER = """
import sys, torch
torch.set_num_threads(1)
from slipstream.queue.client import QueueClient, QueueFull
from slipstream.queue.testing import make_group
with QueueClient(sys.argv[1]) as client:
    for arg in sys.argv[2:]:
        gid, _, timeout = arg.partition("@")
        try:
            stored = client.put(make_group(gid, payload=64), timeout_s=float(timeout or 60))
            print(gid, "stored" if stored else "duplicate", flush=True)
        except QueueFull as err:
            print(gid, "full:", err, flush=True)
"""

# A consumer process that leases and then hangs until it is killed.
HOLDER = """
import sys, time, torch
torch.set_num_threads(1)
from slipstream.queue.client import QueueClient
client = QueueClient(sys.argv[1])
lease = client.lease(int(sys.argv[2]), timeout_s=60)
print(" ".join(g.group_id for g in lease.groups), flush=True)
time.sleep(120)
"""


def _spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, f"child exited early with code {proc.wait()}"
    return line.strip()


def test_a_consumer_killed_while_holding_a_lease_loses_nothing(server_process):
    handle = server_process(lease_timeout_s=1.0, shm_min_group_bytes=2048)
    client = QueueClient(handle.address, timeout_s=30)
    sent = [make_group(f"g{i}", payload=64 * (i % 3)) for i in range(6)]  # arena and socket puts
    assert all(client.put(g) for g in sent)
    holder = _spawn(HOLDER, handle.address, "4")
    try:
        assert _line(holder) == "g0 g1 g2 g3"
    finally:
        holder.kill()
        holder.wait()
    lease = client.lease(6, timeout_s=30)  # the four come back after lease_timeout_s, in front, in order
    assert [g.group_id for g in lease.groups] == [f"g{i}" for i in range(6)]
    for got, want in zip(lease.groups, sent, strict=True):
        for name, tensor in want.tensors.items():
            assert torch.equal(got.tensors[name], tensor)
    client.ack(lease)
    stats = client.stats().partitions["train"]
    assert stats.expired_total == 4 and stats.acked_total == 6
    client.close()


def test_duplicates_from_two_producers_are_stored_once(server_process):
    handle = server_process()
    first = _spawn(PRODUCER, handle.address, *[f"g{i}" for i in range(0, 6)])
    second = _spawn(PRODUCER, handle.address, *[f"g{i}" for i in range(3, 9)])
    results: dict[str, list[str]] = {}
    for proc in (first, second):
        for line in proc.stdout:
            gid, outcome = line.split()
            results.setdefault(gid, []).append(outcome)
        assert proc.wait(30) == 0
    for gid in ("g3", "g4", "g5"):
        assert sorted(results[gid]) == ["duplicate", "stored"], gid
    assert sum(o == ["stored"] for o in results.values()) == 6
    with QueueClient(handle.address, timeout_s=30) as consumer:
        lease = consumer.lease(9, timeout_s=10)
        assert sorted(g.group_id for g in lease.groups) == [f"g{i}" for i in range(9)]
        assert consumer.stats().duplicates_total == 3
        consumer.ack(lease)


def test_back_pressure_holds_a_producer_process_then_fails_clearly(server_process):
    handle = server_process(capacity_groups=2)
    consumer = QueueClient(handle.address, timeout_s=30)
    producer = _spawn(PRODUCER, handle.address, "a", "b", "c", "d", "e", "f@0.3")
    assert [_line(producer), _line(producer)] == ["a stored", "b stored"]
    deadline = time.monotonic() + 30
    while consumer.stats().puts_waiting != 1:  # "c" is parked by the server, not refused
        assert time.monotonic() < deadline, "the third put never started waiting"
        time.sleep(0.05)
    assert consumer.stats().held_groups == 2
    consumer.ack(consumer.lease(1, timeout_s=10))  # room for exactly one
    assert _line(producer) == "c stored"
    assert consumer.stats().held_groups == 2
    consumer.ack(consumer.lease(2, timeout_s=10))  # b and c: room for d and e
    assert [_line(producer), _line(producer)] == ["d stored", "e stored"]
    last = _line(producer)
    assert last.startswith("f full: queue full for 0.3s: holding 2/2 groups"), last
    assert producer.wait(30) == 0
    consumer.close()


def test_snapshot_and_restore_survive_a_server_restart(server_process, tmp_path):
    path = "queue.snap"  # a name in the servers' snapshot_dir (the test's temporary directory)
    first = server_process(shm_min_group_bytes=1024)
    client = QueueClient(first.address, timeout_s=30)
    sent = {
        f"g{i}": make_group(f"g{i}", n=2 + 3 * (i % 2), response_len=60, payload=7, version=i)
        for i in range(6)
    }
    for group in sent.values():
        client.put(group)
    held = client.lease(2, timeout_s=5)  # g0, g1: leased at snapshot time
    client.ack(client.lease(1, timeout_s=5))  # g2 consumed
    client.ack(client.lease(1, timeout_s=5), dropped=["g3"])  # g3 consumed without training
    summary = client.snapshot(path)
    assert summary["groups"] == 4 and summary["leased_groups"] == 2 and summary["dropped"] == 1
    assert summary["consumed_uids"] == 2 + 5  # g2 and g3
    assert [g.group_id for g in held.groups] == ["g0", "g1"]
    client.close()
    first.stop()

    second = server_process()
    client = QueueClient(second.address, timeout_s=30)
    client.put(make_group("new"))
    assert client.restore(path)["groups"] == 4
    assert client.restore(path)["skipped_seen"] == 4  # restoring twice adds nothing
    lease = client.lease(5, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["g0", "g1", "g4", "g5", "new"]
    for got in lease.groups[:4]:
        want = sent[got.group_id]
        assert got.meta == want.meta
        for name, tensor in want.tensors.items():
            assert torch.equal(got.tensors[name], tensor)
    assert client.put(make_group("g2")) is False  # the consumed set came back too
    assert [m.group_id for m in client.pop_dropped()] == ["g3"]
    (tmp_path / "not-a-snapshot").write_bytes(b"garbage" * 10)
    with pytest.raises(QueueError, match="not a slipstream queue snapshot"):
        client.restore("not-a-snapshot")
    client.ack(lease)
    client.close()


def _fuzz_message(rng: random.Random, valid_header: bytes) -> list[bytes]:
    kind = rng.randrange(6)
    if kind == 0:  # pure noise, any number of frames
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 5))]
    type_byte = bytes([rng.choice(list(P.MsgType))])
    if kind == 1:  # a real type, a random header
        return [type_byte, rng.randbytes(rng.randrange(0, 200))]
    if kind == 2:  # a valid header cut short
        return [type_byte, valid_header[: rng.randrange(len(valid_header))]]
    if kind == 3:  # type byte alone, or an empty frame
        return [type_byte] if rng.random() < 0.5 else [b""]
    if kind == 4:  # over max_message_bytes in several frames
        return [type_byte, valid_header, *[b"x" * 30_000] * 3]
    return [bytes([P.MsgType.PUT]), valid_header, rng.randbytes(100)]  # a put whose frames lie


def test_random_truncated_and_oversized_messages_never_kill_the_server(server_process):
    handle = server_process(max_message_bytes=64 * 1024)
    client = QueueClient(handle.address, timeout_s=30)
    client.ping()
    group = make_group("valid", payload=8)
    from slipstream.queue import codec as C

    specs, _ = C.pack_frames(group.tensors, 0)
    put_header = C.Codec().encode(P.MsgType.PUT, P.PutRequest(5, "train", group.meta, specs, 1.0))[1]
    host, port = handle.address[6:].rsplit(":", 1)
    ports = [int(port), client._session.units[0].port]
    ctx = zmq.Context()
    rng = random.Random(1234)
    errors = 0
    for target in ports:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{target}")
        for _ in range(150):
            sock.send_multipart(_fuzz_message(rng, put_header))
            assert sock.poll(10_000), "the server stopped answering"
            reply = sock.recv_multipart()
            errors += reply[0] == bytes([P.MsgType.ERROR])
        sock.send_multipart([b"\x05", b"y" * 200_000])  # one frame over 2x the limit: ZeroMQ drops the peer
        sock.close()
    ctx.term()
    assert errors >= 290  # everything but a freak valid message was refused with an error reply
    for target in ports:  # bytes that are not even ZMTP
        for _ in range(5):
            with socket.create_connection((host, target), timeout=5) as raw:
                raw.sendall(rng.randbytes(rng.randrange(1, 4096)))
    assert handle.is_alive()
    assert client.put(group) is True
    lease = client.lease(1, timeout_s=10)
    assert torch.equal(lease.groups[0].tensors["payload"], group.tensors["payload"])
    client.ack(lease)
    client.close()


def test_random_messages_on_the_direct_channel_never_kill_the_server(server_process):
    from slipstream.queue.codec import Codec, ipc_supported
    from slipstream.queue.direct import abstract_address

    if not ipc_supported():
        pytest.skip("the direct channel needs Linux abstract sockets")
    handle = server_process(max_message_bytes=64 * 1024)
    client = QueueClient(handle.address, timeout_s=30)
    client.ping()
    assert client.transport == "unix"
    address = abstract_address(client._session.direct)
    group = make_group("valid", payload=8)
    put_header = Codec().encode(P.MsgType.PUT, P.PutRequest(5, "train", group.meta, [], 1.0))[1]
    rng = random.Random(99)
    errors = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(address)
        reader = sock.makefile("rb")
        for _ in range(150):
            body = b"".join(
                _fuzz_message(rng, put_header)[:2]
            )  # the direct channel carries no payload frames
            sock.sendall(struct.pack("<I", len(body)) + body)
            (n,) = struct.unpack("<I", reader.read(4))
            errors += reader.read(n)[:1] == bytes([P.MsgType.ERROR])
        sock.sendall(
            struct.pack("<I", 1 << 30)
        )  # a length past the limit: an error, then the server hangs up
        (n,) = struct.unpack("<I", reader.read(4))
        assert b"too_large" in reader.read(n)
        assert reader.read(1) == b""
    assert errors >= 130  # all but the odd valid header under a matching type byte
    for _ in range(5):  # bytes that are not even frames
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(address)
            raw.sendall(rng.randbytes(rng.randrange(1, 4096)))
    assert handle.is_alive()
    assert client.put(group) is True  # all inline: over the direct channel
    lease = client.lease(1, timeout_s=10)
    assert torch.equal(lease.groups[0].tensors["payload"], group.tensors["payload"])
    client.ack(lease)
    client.close()


def test_server_runs_inside_a_ray_actor():
    ray = pytest.importorskip("ray")

    from slipstream.queue.config import QueueConfig
    from slipstream.queue.server import QueueServerActor

    ray.init(address="local", num_cpus=1, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    try:
        cfg = QueueConfig(shm_bytes_per_unit=4 << 20, num_storage_units=1)
        actor = ray.remote(QueueServerActor).options(num_cpus=0).remote(cfg)
        address = ray.get(actor.address.remote(), timeout=120)
        with QueueClient(address, timeout_s=30) as client:
            assert client.put(make_group("r", payload=4096))  # through the actor's arena
            lease = client.lease(1, timeout_s=10)
            assert torch.equal(
                lease.groups[0].tensors["payload"], make_group("r", payload=4096).tensors["payload"]
            )
            client.ack(lease)
        ray.get(actor.stop.remote(), timeout=60)
    finally:
        ray.shutdown()


def test_cli_rejects_a_bad_override(capsys):
    from slipstream.queue.server import main

    assert main(["capacity_groups=lots"]) == 2
    assert "capacity_groups" in capsys.readouterr().err


def _restart_on_the_same_port(server_process, **overrides):
    """A server on a fixed port, and a function that stops it and starts another on that port."""
    from slipstream.utils.net import free_port

    port = free_port()
    first = server_process(port=port, **overrides)

    def restart():
        first.stop()
        second = server_process(port=port, **overrides)
        assert second.address == first.address
        return second

    return first, restart


def test_a_client_reconnects_after_the_server_restarts_on_the_same_port(server_process):
    first, restart = _restart_on_the_same_port(server_process)
    client = QueueClient(first.address, timeout_s=30)
    assert client.put(make_group("a", payload=100))
    assert client.lease(1, timeout_s=5) is not None  # held when the server goes away
    restart()
    assert client.put(make_group("b"))  # all inline: over the direct channel, on a fresh connection
    assert client.put(make_group("c", payload=100))  # through the new server's arena
    lease = client.lease(2, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["b", "c"]
    assert torch.equal(lease.groups[1].tensors["payload"], make_group("c", payload=100).tensors["payload"])
    client.ack(lease)
    client.close()  # the lease of the first server is not handed back to the second


def test_an_async_client_reconnects_after_the_server_restarts_on_the_same_port(server_process):
    import asyncio

    from slipstream.queue.client import AsyncQueueClient

    first, restart = _restart_on_the_same_port(server_process)

    async def scenario():
        client = AsyncQueueClient(first.address, timeout_s=30)
        try:
            assert await client.put(make_group("a", payload=100))
            restart()
            assert await client.put(make_group("b", payload=100))
            lease = await client.lease(1, timeout_s=5)
            assert [g.group_id for g in lease.groups] == ["b"]
            await client.ack(lease)
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_tcp_client_reconnects_after_one_failed_call(server_process):
    first, restart = _restart_on_the_same_port(server_process)
    client = QueueClient(first.address, timeout_s=1, ipc=False)
    assert client.put(make_group("a"))
    restart()
    with pytest.raises(QueueError, match="no reply"):  # sent to the old server's storage unit
        client.put(make_group("b"), timeout_s=0.5)
    assert client.put(make_group("b"))  # the call after says HELLO again
    assert [g.group_id for g in client.lease(1, timeout_s=5).groups] == ["b"]
    client.close()


def test_a_journalled_server_holding_large_groups_stops_on_sigterm(server_process):
    """Acked groups the journal holds (written and still being written) and ready groups in the arena: SIGTERM
    ends the server by itself (exit status 0, no SIGKILL), and stop() reports it."""
    handle = server_process(journal=True, shm_bytes_per_unit=160 << 20, capacity_bytes=1 << 30)
    big = 1 << 21  # bytes per response token: 16 MiB per group
    with QueueClient(handle.address, timeout_s=60) as client:
        for round_ in range(3):
            assert all(client.put(make_group(f"r{round_}-g{i}", payload=big)) for i in range(4))
            client.ack(client.lease(4, timeout_s=30))
        assert all(client.put(make_group(f"ready-{i}", payload=big)) for i in range(2))
        assert client.stats().partitions["train"].acked_total == 12
    assert handle.stop() is True
    assert handle.proc.returncode == 0


def test_a_failed_server_stop_never_masks_the_bench_results(monkeypatch):
    from slipstream.queue import server as server_mod
    from slipstream.system import bench_queue as bench

    real = server_mod.start_queue_server

    def start(cfg):
        handle = real(cfg)
        real_stop = handle.stop

        def stop(timeout_s: float = 10.0):
            real_stop(timeout_s)
            raise subprocess.TimeoutExpired("queue server", timeout_s)

        handle.stop = stop
        return handle

    monkeypatch.setattr(server_mod, "start_queue_server", start)
    out, _ = bench._slipstream([4096], True, True, 0)
    assert out["copy"][4096] > 0 and out["inplace"][4096] > 0
