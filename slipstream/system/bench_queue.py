"""``slipstream bench queue``: TransferQueue throughput and latency against memcpy and Ray's object store.

Method (one run, one machine, the same bytes for every contender):

* **slipstream**: a queue server process, one producer process and one consumer process on loopback (same
  host: control requests over the direct channel, payloads through the shared-memory arena). The producer
  ``put``s groups carrying one payload tensor of ``bytes`` bytes, ``CONCURRENCY`` puts in flight from an
  ``AsyncQueueClient`` (as the rollouter's agent loops do); the consumer ``lease``s half of the in-flight
  window at a time (a trainer leases whole batches), checks a marker byte at both ends of every payload and
  ``ack``s. At most ``WINDOW`` groups (and 1 GiB) are in flight, held by the queue's own back-pressure.
  Throughput is ``count * bytes / (last ack - first put)``. Two kinds of put, each on its own rows:

  - **copy-in** (``slipstream_gbps``): the producer's payload tensor (made once, reused) is copied into the
    arena by ``put``;
  - **in place** (``slipstream_inplace_gbps``): the producer gets the group from ``alloc_group``, writes
    its small columns and the two marker bytes into the arena views and ``put``s it: no payload byte is
    copied by anyone (the rest of the payload is whatever the region held, as copy-in reuses one tensor).

  Both run against a server with the default config and against one with ``queue.journal=true``
  (``*_journal_gbps``: every acked payload is also copied into the journal file, which this benchmark never
  lets go of, as it takes no snapshot; ``slipstream train`` turns the journal on with trainer restarts).
* **ray**: the same two roles as Ray actors: the producer ``ray.put``s a numpy array (Ray's zero-copy path)
  and passes the ref to the consumer actor, which ``ray.get``s it and checks the same marker bytes; the same
  in-flight window.
* **memcpy**: ``dst.copy_(src)`` of the same size in this process, one thread (as each queue process).

Neither consumer copies the payload out: both get a view (an arena view or Ray's plasma view), which is
what a trainer then collates from. Timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC, shared by all
processes of the host). Latency (the first tenth of each series is warm-up): ``latency_us`` is the round
trip of a small request (``ping``) through the queue's client and server (same host: the direct channel),
``latency_tcp_us`` the same over TCP, measured in interleaved blocks; ``put_latency_us`` the round trip of
a put of a ~100-byte group while the consumer drains; ``e2e_latency_us`` put start to the consumer's lease
returning it; ``zmq_echo_us`` and ``unix_echo_us`` bare echoes between two processes over pyzmq (TCP) and
over a plain Unix socket, the floors under the two transports. All worker processes ``gc.freeze()`` after
their imports, as the server does.

Child processes are controlled with JSON lines on stdin/stdout (no pickling); progress goes to stderr and
the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import msgspec

from slipstream.cli_args import add_json_flag, command_parser

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
WINDOW = 8
# Puts in flight from the producer's asyncio client.
CONCURRENCY = 4
INFLIGHT_BYTES = 1 * GiB


def _log(msg: str) -> None:
    print(f"[bench queue] {msg}", file=sys.stderr, flush=True)


def _count(nbytes: int, quick: bool) -> int:
    target = (256 * MiB) if quick else (2 * GiB)
    return max(8, min(2000 if not quick else 300, target // nbytes))


def _window(nbytes: int) -> int:
    """Groups in flight at once (at most 8 and 1 GiB); the consumer takes half of them per lease, so the
    producer fills one half while the consumer holds the other, as a trainer leasing whole batches does."""
    return max(1, min(WINDOW, INFLIGHT_BYTES // nbytes))


def _warmup(nbytes: int) -> int:
    """Untimed puts before each size: two full windows, so every buffer a contender cycles through (arena
    regions, plasma pages) has been touched once."""
    return 2 * _window(nbytes)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9  # gigabits per second


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ------------------------------------------------------------------------------------ worker roles
def _meta(tag: str, i: int):
    from slipstream.queue.types import GroupMeta, SampleMeta

    return GroupMeta(f"{tag}-{i}", [SampleMeta(f"{tag}-{i}-0", 1, 1, 0, 0)])


def _group(tag: str, i: int, payload: Any):
    import torch

    from slipstream.queue.types import TrajectoryGroup

    meta = _meta(tag, i)
    tensors = {
        "prompt_ids": torch.zeros(1, dtype=torch.int32),
        "response_ids": torch.zeros(1, dtype=torch.int32),
        "loss_mask": torch.ones(1, dtype=torch.uint8),
        "logprobs": torch.zeros(1, dtype=torch.float32),
        "versions": torch.zeros(1, dtype=torch.int32),
        "payload": payload,
    }
    return TrajectoryGroup(meta, tensors)


def _producer(client: Any, cmd: dict) -> dict:
    import torch

    if cmd["cmd"] == "ping":  # through this client (same host: the direct channel), then over TCP
        from slipstream.queue.client import QueueClient

        tcp = QueueClient(client.address, timeout_s=120, ipc=False)
        tcp.ping()
        rtts: dict[str, list[float]] = {"local": [], "tcp": []}
        for _ in range(cmd["count"] // 100):  # interleaved blocks, so both see the same machine load
            for name, c in (("local", client), ("tcp", tcp)):
                for _ in range(100):
                    t0 = time.perf_counter()
                    c.ping()
                    rtts[name].append(time.perf_counter() - t0)
        tcp.close()
        return {"rtt": rtts}
    if cmd["cmd"] == "latency":
        starts = {}
        rtts = []
        for i in range(cmd["count"]):
            group = _group(cmd["tag"], i, torch.zeros(1, 64, dtype=torch.uint8))
            t0 = time.perf_counter()
            client.put(group, timeout_s=60)
            rtts.append(time.perf_counter() - t0)
            starts[group.group_id] = t0
        return {"rtt": rtts, "starts": starts}
    return asyncio.run(_produce(client.address, cmd))


async def _produce(address: str, cmd: dict) -> dict:
    """``CONCURRENCY`` puts in flight from one asyncio client, as the rollouter's agent loops do.

    Each in-flight put owns a payload buffer until its reply: a socket put sends the buffer zero-copy, and
    the reply is what says the server has the bytes.
    """
    import torch

    from slipstream.queue.client import AsyncQueueClient

    nbytes, count = cmd["bytes"], cmd["count"]
    free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
    for _ in range(0 if cmd.get("inplace") else CONCURRENCY):
        free.put_nowait(torch.ones(1, nbytes, dtype=torch.uint8))

    async def one(i: int) -> None:
        payload = await free.get()
        payload[0, 0] = payload[0, -1] = i % 251
        if not await client.put(_group(cmd["tag"], i, payload), timeout_s=120):
            raise RuntimeError("benchmark group refused as a duplicate")
        free.put_nowait(payload)

    async def one_in_place(i: int) -> None:
        # The producer's data is made where the queue keeps it: the standard columns and the two marker
        # bytes are written into the arena (as copy-in mode writes them into its source tensor); the
        # payload's other bytes are whatever the region held (copy-in mode reuses a source tensor too).
        group = await client.alloc_group(_meta(cmd["tag"], i), {"payload": ((1, nbytes), torch.uint8)})
        for name in ("prompt_ids", "response_ids", "logprobs", "versions"):
            group.tensors[name].zero_()
        group.tensors["loss_mask"].fill_(1)
        group.tensors["payload"][0, 0] = group.tensors["payload"][0, -1] = i % 251
        if not await client.put(group, timeout_s=120):
            raise RuntimeError("benchmark group refused as a duplicate")

    put_one = one_in_place if cmd.get("inplace") else one

    async with AsyncQueueClient(address, timeout_s=120) as client:
        await client.ping()
        t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()
        for i in range(count):
            while len(tasks) >= CONCURRENCY:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            tasks.add(asyncio.ensure_future(put_one(i)))
        for task in asyncio.as_completed(tasks):
            await task
    return {"t_start": t0}


def _consumer(client: Any, cmd: dict) -> dict:
    got: dict[str, float] = {}
    bad = 0
    while len(got) < cmd["count"]:
        want = min(cmd.get("batch", 1), cmd["count"] - len(got))
        lease = client.lease(want, min_groups=min(want, cmd.get("min_groups", want)), timeout_s=120)
        if lease is None:
            raise RuntimeError("consumer timed out waiting for groups")
        now = time.perf_counter()
        for g in lease.groups:
            i = int(g.group_id.rsplit("-", 1)[1])
            p = g.tensors["payload"]
            bad += int(p[0, 0]) != (i % 251 if cmd["cmd"] == "throughput" else 0) or int(p[0, -1]) != int(
                p[0, 0]
            )
            got[g.group_id] = now
        client.ack(lease)
    return {"t_end": time.perf_counter(), "bad": bad, "got": got if cmd["cmd"] == "latency" else {}}


def _worker(role: str, address: str) -> int:
    import torch

    from slipstream.queue.client import QueueClient
    from slipstream.queue.server import freeze_imports

    torch.set_num_threads(int(os.environ.get("SLIPSTREAM_BENCH_THREADS", "1")))
    freeze_imports()  # as the server does: keep full GC passes over torch's objects out of the timings
    client = QueueClient(address, timeout_s=120)
    client.ping()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        result = (_producer if role == "producer" else _consumer)(client, cmd)
        print(json.dumps(result), flush=True)
    client.close()
    return 0


class _Child:
    """A bench worker process driven by JSON lines."""

    def __init__(self, role: str, address: str) -> None:
        cmd = [sys.executable, "-m", "slipstream.system.bench_queue", "--role", role, "--address", address]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()

    def send(self, cmd: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.send({"cmd": "exit"})
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------------- contenders
def _slipstream(
    sizes: list[int], quick: bool, journal: bool, latency_n: int
) -> tuple[dict, dict[str, float]]:
    """Throughput per size of copy-in puts and of in-place puts (``alloc_group``) on one server, and, with
    ``latency_n``, the round trips; ``journal`` is the server's ``queue.journal``."""
    from slipstream.queue.config import QueueConfig
    from slipstream.queue.server import start_queue_server

    top = max(sizes)
    cfg = QueueConfig(
        capacity_groups=WINDOW,
        capacity_bytes=INFLIGHT_BYTES + MiB,
        shm_bytes_per_unit=max(64 * MiB, INFLIGHT_BYTES // 2 + top + MiB),
        journal=journal,
    )
    server = start_queue_server(cfg)
    producer = _Child("producer", server.address)
    consumer = _Child("consumer", server.address)
    out: dict[str, dict[int, float]] = {"copy": {}, "inplace": {}}
    label = "journal" if journal else "no journal"
    try:
        for nbytes in sizes:
            for mode in ("copy", "inplace"):
                out[mode][nbytes] = _throughput(producer, consumer, nbytes, _count(nbytes, quick), mode)
                _log(f"slipstream {mode:>7} ({label}) {nbytes:>10} B: {out[mode][nbytes]:8.2f} Gbit/s")
        lat = _latency(producer, consumer, latency_n) if latency_n else {}
    finally:
        _shut_down([producer.close, consumer.close, server.stop], label)
    return out, lat


def _shut_down(steps: list, label: str) -> None:
    """Run every clean-up step; a failure is logged, never raised, so it cannot mask the measured results
    (or the error that ended the measurement)."""
    for step in steps:
        try:
            if step() is False:
                _log(f"clean-up of the {label} server: {step.__qualname__} did not complete")
        except Exception as err:  # noqa: BLE001 - see the docstring
            _log(f"clean-up of the {label} server: {step.__qualname__} failed: {type(err).__name__}: {err}")


def _throughput(producer: _Child, consumer: _Child, nbytes: int, count: int, mode: str) -> float:
    for tag, n in ((f"w{mode}{nbytes}", _warmup(nbytes)), (f"m{mode}{nbytes}", count)):
        batch = max(1, _window(nbytes) // 2)
        consumer.send({"cmd": "throughput", "count": n, "bytes": nbytes, "batch": batch})
        producer.send(
            {"cmd": "throughput", "count": n, "bytes": nbytes, "tag": tag, "inplace": mode == "inplace"}
        )
        t_start = producer.read()["t_start"]
        done = consumer.read()
        if done["bad"]:
            raise RuntimeError(f"{done['bad']} payload(s) arrived corrupted at {nbytes} bytes ({mode})")
    return _gbps(count * nbytes, done["t_end"] - t_start)


def _latency(producer: _Child, consumer: _Child, latency_n: int) -> dict[str, float]:
    producer.send({"cmd": "ping", "count": latency_n})  # the consumer is idle meanwhile
    ping = producer.read()["rtt"]
    # the consumer takes whatever is ready, so no backlog builds up behind it
    consumer.send({"cmd": "latency", "count": latency_n, "batch": WINDOW, "min_groups": 1})
    producer.send({"cmd": "latency", "count": latency_n, "tag": "lat"})
    sent = producer.read()
    got = consumer.read()["got"]
    warm = latency_n // 10  # the first tenth warms up
    series = {
        "ping": [x * 1e6 for x in ping["local"][warm:]],
        "ping_tcp": [x * 1e6 for x in ping["tcp"][warm:]],
        "put": [x * 1e6 for x in sent["rtt"][warm:]],
        "e2e": [(got[g] - t) * 1e6 for g, t in list(sent["starts"].items())[warm:] if g in got],
    }
    lat = {}
    for name, values in series.items():
        lat[f"{name}_p50"], lat[f"{name}_p99"] = _pct(values, 0.5), _pct(values, 0.99)
    _log(
        f"round trip p50/p99: ping {lat['ping_p50']:.0f}/{lat['ping_p99']:.0f} us (over TCP "
        f"{lat['ping_tcp_p50']:.0f}/{lat['ping_tcp_p99']:.0f}), tiny put {lat['put_p50']:.0f}/"
        f"{lat['put_p99']:.0f} us, put-to-lease {lat['e2e_p50']:.0f}/{lat['e2e_p99']:.0f} us"
    )
    return lat


_ECHO_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
"""


def _zmq_echo(n: int) -> dict[str, float]:
    """The floor under any round trip here: a bare pyzmq DEALER/ROUTER echo between two processes."""
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{int(proc.stdout.readline())}")
        rtts = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send_multipart([b"\x0d", b"x" * 40])
            if not sock.poll(10_000):
                raise RuntimeError("the echo process stopped answering")
            sock.recv_multipart()
            rtts.append((time.perf_counter() - t0) * 1e6)
    finally:
        sock.close(0)
        ctx.term()
        proc.kill()
        proc.wait()
    rtts = rtts[n // 10 :]
    _log(f"raw zmq echo round trip p50/p99: {_pct(rtts, 0.5):.0f}/{_pct(rtts, 0.99):.0f} us")
    return {"p50": _pct(rtts, 0.5), "p99": _pct(rtts, 0.99)}


_UNIX_ECHO_SERVER = """
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\\0" + sys.argv[1]); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept()
while data := conn.recv(65536):
    conn.sendall(data)
"""


def _unix_echo(n: int) -> dict[str, float]:
    """The floor under the direct channel: a bare echo over a plain Unix socket between two processes."""
    import socket

    name = f"slipstream-bench-echo-{os.getpid()}"  # an abstract name (the leading NUL is added below)
    proc = subprocess.Popen(
        [sys.executable, "-c", _UNIX_ECHO_SERVER, name], stdout=subprocess.PIPE, text=True
    )
    try:
        proc.stdout.readline()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + name)
            rtts = []
            for _ in range(n):
                t0 = time.perf_counter()
                sock.sendall(b"x" * 48)
                sock.recv(65536)
                rtts.append((time.perf_counter() - t0) * 1e6)
    finally:
        proc.kill()
        proc.wait()
    rtts = rtts[n // 10 :]
    _log(f"raw unix socket echo round trip p50/p99: {_pct(rtts, 0.5):.0f}/{_pct(rtts, 0.99):.0f} us")
    return {"p50": _pct(rtts, 0.5), "p99": _pct(rtts, 0.99)}


def _ray_consume(refs: list, i: int) -> tuple[float, bool]:
    import ray

    arr = ray.get(refs[0])
    return time.perf_counter(), int(arr[0]) == i % 251 and int(arr[-1]) == i % 251


def _ray_produce(consumer: Any, nbytes: int, count: int, window: int) -> dict:
    import numpy as np
    import ray

    arr = np.ones(nbytes, dtype=np.uint8)
    pending: list = []
    results: list = []
    t0 = time.perf_counter()
    for i in range(count):
        arr[0] = arr[-1] = i % 251
        ref = ray.put(arr)
        pending.append(consumer.consume.remote([ref], i))
        del ref
        if len(pending) >= window:
            done, pending = ray.wait(pending, num_returns=1)
            results += ray.get(done)
    results += ray.get(pending)
    return {"t_start": t0, "t_end": max(t for t, _ in results), "bad": sum(not ok for _, ok in results)}


class RayConsumer:
    def consume(self, refs: list, i: int) -> tuple[float, bool]:
        return _ray_consume(refs, i)


class RayProducer:
    def run(self, consumer: Any, nbytes: int, count: int, window: int) -> dict:
        return _ray_produce(consumer, nbytes, count, window)


def _ray(sizes: list[int], quick: bool) -> dict[int, float]:
    import ray

    top = max(sizes)
    store = max(512 * MiB, INFLIGHT_BYTES + 2 * top + 256 * MiB)
    ray.init(address="local", num_cpus=4, object_store_memory=store, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    out: dict[int, float] = {}
    try:
        consumer = ray.remote(num_cpus=1)(RayConsumer).remote()
        producer = ray.remote(num_cpus=1)(RayProducer).remote()
        for nbytes in sizes:
            count, window = _count(nbytes, quick), _window(nbytes)
            ray.get(producer.run.remote(consumer, nbytes, _warmup(nbytes), window))
            res = ray.get(producer.run.remote(consumer, nbytes, count, window))
            if res["bad"]:
                raise RuntimeError(f"ray delivered {res['bad']} corrupted payload(s)")
            out[nbytes] = _gbps(count * nbytes, res["t_end"] - res["t_start"])
            _log(f"ray        {nbytes:>10} B x {count:>4}: {out[nbytes]:8.2f} Gbit/s")
    finally:
        ray.shutdown()
    return out


def _memcpy(sizes: list[int]) -> dict[int, float]:
    import torch

    torch.set_num_threads(1)  # one copy stream, like each queue process (threads fight on a busy machine)
    out = {}
    for nbytes in sizes:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        reps = max(5, min(2000, (2 * GiB) // nbytes))
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        out[nbytes] = _gbps(reps * nbytes, time.perf_counter() - t0)
        _log(f"memcpy     {nbytes:>10} B x {reps:>4}: {out[nbytes]:8.2f} Gbit/s")
    return out


# ---------------------------------------------------------------------------------------------- CLI
class BenchRow(msgspec.Struct):
    bytes: int
    # copy-in puts (the producer's tensors are copied into shared memory), default server config
    slipstream_gbps: float
    ray_gbps: float
    memcpy_gbps: float
    # in-place puts (alloc_group: the producer's data is made in shared memory; no payload byte is copied)
    slipstream_inplace_gbps: float
    # the same two with queue.journal=true (every acked payload is also copied to the journal file)
    slipstream_journal_gbps: float
    slipstream_inplace_journal_gbps: float


def run(sizes: list[int], quick: bool = False, with_ray: bool = True) -> dict[str, Any]:
    latency_n = 300 if quick else 2000
    memcpy = _memcpy(sizes)
    echo = _zmq_echo(latency_n)
    unix_echo = _unix_echo(latency_n)
    ours, lat = _slipstream(sizes, quick, False, latency_n)
    journalled, _ = _slipstream(sizes, quick, True, 0)
    ray_ = _ray(sizes, quick) if with_ray else {}
    rows = [
        BenchRow(
            n,
            round(ours["copy"][n], 3),
            round(ray_.get(n, float("nan")), 3),
            round(memcpy[n], 3),
            round(ours["inplace"][n], 3),
            round(journalled["copy"][n], 3),
            round(journalled["inplace"][n], 3),
        )
        for n in sizes
    ]
    return {
        "rows": msgspec.to_builtins(rows),
        "latency_us_p50": round(lat["ping_p50"], 1),
        "latency_us_p99": round(lat["ping_p99"], 1),
        "latency_tcp_us_p50": round(lat["ping_tcp_p50"], 1),
        "latency_tcp_us_p99": round(lat["ping_tcp_p99"], 1),
        "put_latency_us_p50": round(lat["put_p50"], 1),
        "put_latency_us_p99": round(lat["put_p99"], 1),
        "e2e_latency_us_p50": round(lat["e2e_p50"], 1),
        "e2e_latency_us_p99": round(lat["e2e_p99"], 1),
        "zmq_echo_us_p50": round(echo["p50"], 1),
        "zmq_echo_us_p99": round(echo["p99"], 1),
        "unix_echo_us_p50": round(unix_echo["p50"], 1),
        "unix_echo_us_p99": round(unix_echo["p99"], 1),
        "units": (
            "gbps = 1e9 bits/s; slipstream = copy-in put, inplace = alloc_group put (no payload copy), "
            "journal = server with queue.journal=true; latency = round trip of a small request through the "
            "queue client and server (same host: the direct channel), latency_tcp = the same over TCP; "
            "put_latency = round trip of a put of a ~100-byte group while a consumer drains; e2e = put start to "
            "lease return; zmq_echo / unix_echo = bare pyzmq TCP / plain Unix socket echo between two processes"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(
        "slipstream bench queue",
        "TransferQueue throughput and latency against memcpy and Ray's object store.",
    )
    # Hand-written: payload sizes and the baselines to run are the bench's own, no config key.
    add_json_flag(parser)
    parser.add_argument("--sizes", type=str, help="comma-separated payload sizes in bytes")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray baseline")
    parser.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return _worker(args.role, args.address)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    result = run(sizes, args.quick, not args.no_ray)
    if not args.json:
        for row in result["rows"]:
            print(
                f"{row['bytes']:>10} B  slipstream {row['slipstream_gbps']:8.2f} (in place "
                f"{row['slipstream_inplace_gbps']:8.2f}; journal {row['slipstream_journal_gbps']:8.2f} / "
                f"{row['slipstream_inplace_journal_gbps']:8.2f})  ray {row['ray_gbps']:8.2f}  "
                f"memcpy {row['memcpy_gbps']:8.2f} Gbit/s"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
