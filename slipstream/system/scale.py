"""``slipstream bench scale``: the control plane (queue, rollouter, weight publisher) against 8-256 servers.

Everything but the model is real: a queue server process, the rollouter (staleness gate, load balancer over
one :class:`~slipstream.serverkinds.sglang.SGLangClient` per server, partial-rollout resumption,
reward scoring, puts) in this process, ``--consumers`` simulated trainers in a child process that lease
batches and ack them at once (real queue clients), and trainer rank 0's push in another child process, the
real :class:`~slipstream.weightsync.publisher.WeightPublisher` pushing a version every ``batch_groups``
acked groups (its own process: a trainer rank acks and then pushes, never both at once). The
inference servers are :mod:`slipstream.system.sim_servers`: real HTTP servers speaking the SGLang-style API,
``--servers-per-proc`` of them per child process, decoding on a clock at ``--tokens-per-s`` per request
with log-normal response lengths (median ``--median-tokens``, sigma 0.6, capped at ``--max-new-tokens``).

Per server count N, a fresh set of processes runs ``--warmup-s`` then ``--seconds`` of measurement:

* ``groups_s``: groups acked by the trainers per second over the measured window;
* ``queue_p50_us`` / ``queue_p99_us``: round trips of the queue requests that never wait by design, puts
  (timed in the rollouter, so they include its event loop's delay) and acks (timed in the trainers);
  ``ping_p99_us`` is a bare ping from the trainers' process every 10 ms, the queue server's own latency;
* ``fanout_s``: median wall time of a weight push to all N servers with no data plane: the publisher runs
  its adapters' whole control sequence (``/begin_weight_update``, one ``/update_weights_from_distributed``
  per bucket, ``/end_weight_update`` with ``abort_running``, which pauses around the switch) over a link
  that sends no bytes. The trainers' acks drive the pushes: every ``batch_groups`` acked groups is one version;
  with ``async.partial_rollout = abort`` every push aborts what is in flight and the rollouter resumes it;
  ``fanout_idle_s``: the same push before generation starts (median of three), the fan-out on its own;
* ``controller_cpu``: CPU seconds of the rollouter process (with its reward workers) and of the queue
  server over the window's wall seconds (1.0 = one core); ``rss_mb``: their peak resident memory.

The gate's batch grows with the cluster, as a real run's would: ``trainer.batch_groups`` = N, ``rollout.n``
= 4, ``max_concurrent_per_server`` = ``--concurrency``, staleness threshold 1, so about N·concurrency/4
groups are in flight. On a small shared machine pick a token rate at which the servers' aggregate demand
stays well under one core: the point is what the control plane costs per server, not CPU saturation.

The last stdout line of ``--json`` is ``{"rows": [{"servers", "groups_s", "queue_p50_us", "queue_p99_us",
"fanout_s", "controller_cpu", "rss_mb", ...}], "config": {...}}``. Child processes talk JSON lines over
pipes (no pickling); everything binds loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.queue.base import QueueProducer
from slipstream.serverkinds import server_kind

DEFAULT_SERVERS = [8, 32, 128, 256]
SAMPLES_PER_GROUP = 4


def _log(msg: str) -> None:
    print(f"[bench scale] {msg}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------------------------- trainers (child)
def _no_bytes_link(cfg: Any, adapters: list[Any], group_name: str) -> Any:
    """The publisher's link over a transport that moves nothing: a push is its control messages alone."""
    from slipstream.weightsync.servers import ServerLink
    from slipstream.weightsync.torch_dist import TorchDistTransport

    class NoBytes(TorchDistTransport):
        def _before_send(self, version: int) -> None:  # no group to check: nobody joined one
            return None

        def send_payload(self, bucket: Any) -> None:
            return None

    class NoBytesLink(ServerLink):
        async def close(self, adapters: Any) -> None:  # the servers never joined a group to leave
            return None

    return NoBytesLink(NoBytes(cfg, is_sender=True, device="cpu"), group_name)  # a group: joins "group"


def _control_only_publisher(urls: list[str], pause_mode: str):
    """The trainer's :class:`WeightPublisher` with its real adapters over a link that sends no bytes."""
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.publisher import WeightPublisher

    class ControlOnlyPublisher(WeightPublisher):
        async def _ensure_link(self, report):  # no process group to build: the link sends no bytes
            members = self._live()
            if self._link is None or members != self._link_members:
                adapters = [self.servers[u] for u in members]
                self._link = _no_bytes_link(self.cfg, adapters, self.cfg.group_name)
                self._link_members = members
            return members

    # naive: one update call per tensor, so --buckets tensors make that many calls per server and push
    cfg = WeightSyncConfig(
        backend="naive", keep_last=False, device="cpu", timeout_s=120, pause_mode=pause_mode
    )
    return ControlOnlyPublisher(cfg, urls, server_kind("embedded"), token="")


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def _trainers(address: str, consumers: int, lease_groups: int) -> None:
    """The trainers' process: ``consumers`` queue clients lease ``lease_groups`` and ack at once, and a
    pinger; every ack is reported on stdout (the controller has the publisher push a version every
    ``batch_groups`` acked groups). Stops when stdin closes."""
    from slipstream.queue.client import AsyncQueueClient

    loop = asyncio.get_running_loop()
    clients = [AsyncQueueClient(address) for _ in range(consumers + 1)]
    acks: list[tuple[float, float]] = []
    pings: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def trainer(client: AsyncQueueClient) -> None:
        while not stop.is_set():
            lease = await client.lease(lease_groups, timeout_s=0.5, min_groups=1)
            if lease is None:
                continue
            t0 = time.perf_counter()
            await client.ack(lease)
            t1 = time.perf_counter()
            acks.append((t1, t1 - t0))
            _emit({"acked": len(lease.groups)})

    async def pinger(client: AsyncQueueClient) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.ping()
            t1 = time.perf_counter()
            pings.append((t1, t1 - t0))
            await asyncio.sleep(0.01)

    for client in clients:
        await client.ping()  # connected (and imports done) before the controller starts its clock
    _emit({"ready": True})
    tasks = [asyncio.create_task(trainer(c)) for c in clients[:-1]]
    tasks.append(asyncio.create_task(pinger(clients[-1])))
    await loop.run_in_executor(None, sys.stdin.read)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()
    _emit({"acks": acks, "pings": pings})


def _publisher() -> None:
    """Trainer rank 0's push, in a process of its own: reads its setup as one JSON line on stdin, pushes
    three versions before generation starts (``idle_push_s``), then one version per ``{"version"}`` line,
    reporting each; stops when stdin closes.

    Not in the trainers' process: a trainer rank acks its batch and then pushes, one after the other, so
    its queue requests never wait for a push's thread; sharing one process here would time the GIL."""
    import torch

    setup = json.loads(sys.stdin.readline())
    publisher = _control_only_publisher(setup["urls"], setup["pause_mode"])
    tensors = [(f"layer{i}.weight", torch.zeros(4)) for i in range(setup["buckets"])]
    try:
        idle = []  # version 0 again: the servers' version does not move
        for _ in range(3):
            t0 = time.perf_counter()
            publisher.publish(0, list(tensors))
            idle.append(time.perf_counter() - t0)
        _emit({"ready": True, "idle_push_s": sorted(idle)[1]})
        for line in sys.stdin:
            version = int(json.loads(line)["version"])
            t0 = time.perf_counter()
            report = publisher.publish(version, list(tensors))
            t1 = time.perf_counter()
            failed = next(iter(report.failed.values()), "")
            _emit({"version": version, "t": t1, "push_s": t1 - t0, "ok": len(report.ok), "failed": failed})
    finally:
        publisher.close()


# ---------------------------------------------------------------------------------------- controller side
class _TimedQueue(QueueProducer):
    """The rollouter's queue client, timing each put (the request's round trip as the rollouter sees it)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.puts: list[tuple[float, float]] = []

    async def put(self, group, *, partition: str = "train", timeout_s: float | None = None) -> bool:
        t0 = time.perf_counter()
        stored = await self.client.put(group, partition=partition, timeout_s=timeout_s)
        t1 = time.perf_counter()
        self.puts.append((t1, t1 - t0))
        return stored

    async def pop_dropped(self, max_groups: int = 1024):
        return await self.client.pop_dropped(max_groups)


def _config(n_servers: int, args: argparse.Namespace):
    from slipstream.config import load_config

    overrides = {
        "rollout.backend": "sglang",
        "rollout.num_servers": n_servers,
        "rollout.n": SAMPLES_PER_GROUP,
        "rollout.max_concurrent_per_server": args.concurrency,
        "rollout.sampling.max_new_tokens": args.max_new_tokens,
        "rollout.request_timeout_s": 600,
        "trainer.batch_groups": max(1, n_servers * args.batch_per_server),
        "async.mode": "fully_async",
        "async.sync_every": 1,
        "async.staleness_threshold": 1.0,
        "async.partial_rollout": args.partial_rollout,
        "agent.name": "single_turn",
        "reward.num_workers": 1,
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def _prompts(count: int = 512):
    from slipstream.agents.data import PromptSource, Sample

    samples = [
        Sample(
            index=i,
            messages=[{"role": "user", "content": f"What is {i % 17} + {i % 5}?"}],
            data_source="arithmetic",
            ground_truth=str(i % 17 + i % 5),
        )
        for i in range(count)
    ]
    return PromptSource(samples, shuffle=False, epochs=10_000)


class _Usage:
    """CPU seconds and peak RSS of the controller processes (this one with its reward workers; the queue)."""

    def __init__(self, queue_pid: int, foreign: set[int]) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.queue = psutil.Process(queue_pid)
        self.foreign = foreign  # children that are not the controller's (servers, trainers, the queue)
        self.peak_rss = {"rollouter": 0, "queue": 0}
        self.workers: list[Any] = []

    def find_workers(self) -> None:
        """The controller's own child processes (reward workers), looked up once: listing /proc costs CPU."""
        self.workers = [
            child
            for child in self.me.children(recursive=True)
            if child.pid not in self.foreign and not any(p.pid in self.foreign for p in child.parents())
        ]

    def _workers(self) -> list[Any]:
        return self.workers

    def cpu(self) -> dict[str, float]:
        def seconds(proc: Any) -> float:
            try:
                t = proc.cpu_times()
            except self._psutil.Error:
                return 0.0
            return t.user + t.system

        return {
            "rollouter": seconds(self.me) + sum(seconds(w) for w in self._workers()),
            "queue": seconds(self.queue),
        }

    def sample_rss(self) -> None:
        def rss(procs: list[Any]) -> int:
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except self._psutil.Error:
                    pass
            return total

        self.peak_rss["rollouter"] = max(self.peak_rss["rollouter"], rss([self.me, *self._workers()]))
        self.peak_rss["queue"] = max(self.peak_rss["queue"], rss([self.queue]))


async def _spawn(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26
    )


async def _start_servers(
    n: int, args: argparse.Namespace
) -> tuple[list[asyncio.subprocess.Process], list[str]]:
    procs, urls = [], []
    for first in range(0, n, max(1, args.servers_per_proc)):
        count = min(args.servers_per_proc, n - first)
        proc = await _spawn(
            "-m", "slipstream.system.sim_servers", "--servers", str(count),
            "--tokens-per-s", str(args.tokens_per_s), "--median-tokens", str(args.median_tokens),
            "--seed", str(first),
        )  # fmt: skip
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("a simulated server process exited before listening")
        procs.append(proc)
        urls.extend(json.loads(line)["urls"])
    return procs, urls


async def _finish_child(proc: asyncio.subprocess.Process) -> dict:
    """Close the child's stdin (its signal to stop) and return the last JSON line it prints."""
    proc.stdin.close()
    last: dict = {}
    while line := await proc.stdout.readline():
        try:
            last = json.loads(line)
        except ValueError:
            continue
    await proc.wait()
    return last


class _Versions:
    """Acked groups from the trainers' process; a push asked of the publisher's every ``batch_groups`` of
    them (one at a time, as a trainer with ``sync_every`` 1 pushes after each batch); each pushed version
    opens the rollouter's gate."""

    def __init__(self, rollouter: Any, publisher: asyncio.subprocess.Process, batch_groups: int) -> None:
        self.rollouter = rollouter
        self.publisher = publisher
        self.batch_groups = batch_groups
        self.acked = 0
        self.asked = 0  # the last version asked for
        self.pushes: list[tuple[float, float, int]] = []  # (end time, seconds, servers reached)

    def _ask(self) -> None:
        if len(self.pushes) == self.asked and self.acked >= (self.asked + 1) * self.batch_groups:
            self.asked += 1
            self.publisher.stdin.write((json.dumps({"version": self.asked}) + "\n").encode())

    async def follow_trainers(self, proc: asyncio.subprocess.Process) -> None:
        while line := await proc.stdout.readline():
            record = json.loads(line)
            if "acked" not in record:
                self.final = record
                return
            self.acked += int(record["acked"])
            self._ask()

    async def follow_publisher(self) -> None:
        while line := await self.publisher.stdout.readline():
            record = json.loads(line)
            self.pushes.append((record["t"], record["push_s"], record["ok"]))
            if record["failed"]:
                _log(f"push {record['version']} failed on some servers: {record['failed']}")
            self.rollouter.set_version(int(record["version"]))
            self._ask()


async def _row(n: int, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    from slipstream.config import rollouter_settings
    from slipstream.queue.client import AsyncQueueClient
    from slipstream.queue.config import QueueConfig
    from slipstream.queue.server import start_queue_server
    from slipstream.rollouter.balancer import balancer_from_config
    from slipstream.rollouter.rollouter import Rollouter

    cfg = _config(n, args)
    handle = start_queue_server(QueueConfig(num_storage_units=2, shm_bytes_per_unit=32 << 20))
    sims: list[asyncio.subprocess.Process] = []
    trainers = publisher = None
    try:
        sims, urls = await _start_servers(n, args)
        lease_groups = max(1, cfg.trainer.batch_groups // args.consumers)
        publisher = await _spawn("-m", "slipstream.system.scale", "--role", "publisher")
        setup = {
            "urls": urls,
            "buckets": args.buckets,
            "pause_mode": "in_place" if args.partial_rollout == "in_place" else "abort",
        }
        publisher.stdin.write((json.dumps(setup) + "\n").encode())
        ready = await publisher.stdout.readline()
        if not ready:
            raise RuntimeError("the publisher's process exited before it was ready")
        idle_push_s = json.loads(ready)["idle_push_s"]
        trainers = await _spawn(
            "-m", "slipstream.system.scale", "--role", "trainers", "--address", handle.address,
            "--consumers", str(args.consumers), "--lease-groups", str(lease_groups),
        )  # fmt: skip
        if not await trainers.stdout.readline():
            raise RuntimeError("the trainers' process exited before it was ready")
        queue = _TimedQueue(AsyncQueueClient(handle.address))
        balancer = balancer_from_config(server_kind(cfg.rollout.backend), cfg.rollout, urls)
        rollouter = Rollouter(rollouter_settings(cfg), balancer, queue, tokenizer, _prompts())
        foreign = {handle.proc.pid, trainers.pid, publisher.pid, *(p.pid for p in sims)}
        usage = _Usage(handle.proc.pid, foreign)
        pusher = _Versions(rollouter, publisher, cfg.trainer.batch_groups)
        tasks = [
            asyncio.create_task(rollouter.run()),
            asyncio.create_task(pusher.follow_trainers(trainers)),
            asyncio.create_task(pusher.follow_publisher()),
        ]
        profiler = None
        try:
            await _sleep_sampling(args.warmup_s, usage, tasks)
            usage.find_workers()
            t0, acked0, cpu0 = time.perf_counter(), pusher.acked, usage.cpu()
            if args.profile:
                import cProfile

                profiler = cProfile.Profile(time.thread_time)  # this thread's CPU, not the machine's load
                profiler.enable()
            await _sleep_sampling(args.seconds, usage, tasks)
            t1, acked1, cpu1 = time.perf_counter(), pusher.acked, usage.cpu()
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(os.path.join(args.profile, f"scale_{n}.pstats"))
            metrics = rollouter.metrics()
        finally:
            await rollouter.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await balancer.aclose()
            await queue.client.close()
        done = await _finish_child(trainers)
        trainers = None
        publisher.stdin.close()
        await publisher.wait()
        publisher = None
    finally:
        for child in (trainers, publisher):
            if child is not None:
                child.kill()
        counts = [await _finish_child(p) for p in sims]
        handle.stop()
    wall = t1 - t0
    in_window = lambda samples: [s for t, s in samples if t0 <= t <= t1]  # noqa: E731
    puts, acks = in_window(queue.puts), in_window(done.get("acks", []))
    pings = in_window(done.get("pings", []))
    requests = [*puts, *acks]
    fanouts = [s for t, s, _ in pusher.pushes[1:]] or [s for _, s, _ in pusher.pushes]
    sim_counts: dict[str, int] = {}
    for c in counts:
        for k, v in c.get("counts", {}).items():
            sim_counts[k] = sim_counts.get(k, 0) + v
    return {
        "servers": n,
        "groups_s": round((acked1 - acked0) / wall, 2),
        "queue_p50_us": round(_pct(requests, 0.5) * 1e6, 1),
        "queue_p99_us": round(_pct(requests, 0.99) * 1e6, 1),
        "fanout_s": round(statistics.median(fanouts), 4) if fanouts else None,
        "controller_cpu": round((sum(cpu1.values()) - sum(cpu0.values())) / wall, 3),
        "rss_mb": round(sum(usage.peak_rss.values()) / 2**20, 1),
        "put_p99_us": round(_pct(puts, 0.99) * 1e6, 1),
        "ack_p99_us": round(_pct(acks, 0.99) * 1e6, 1),
        "ping_p99_us": round(_pct(pings, 0.99) * 1e6, 1),
        "fanout_max_s": round(max(fanouts), 4) if fanouts else None,
        "fanout_idle_s": round(idle_push_s, 4),
        "pushes": len(pusher.pushes),
        "rollouter_cpu": round((cpu1["rollouter"] - cpu0["rollouter"]) / wall, 3),
        "queue_cpu": round((cpu1["queue"] - cpu0["queue"]) / wall, 3),
        "rollouter_rss_mb": round(usage.peak_rss["rollouter"] / 2**20, 1),
        "queue_rss_mb": round(usage.peak_rss["queue"] / 2**20, 1),
        "tokens_s": round(metrics.get("rollouter/generated_tokens_per_s", float("nan")), 1)
        if metrics
        else None,
        "resumes": rollouter.client.resumes,
        "groups_total": pusher.acked,
        "sim_requests": sim_counts.get("generate", 0),
        "loadavg_1m": round(os.getloadavg()[0], 1),  # the machine's, others' work included
    }


async def _sleep_sampling(seconds: float, usage: _Usage, tasks: list[asyncio.Task]) -> None:
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        usage.sample_rss()
        done = [t for t in tasks if t.done()]
        for task in done:
            task.result()  # a failed part ends the run with its error
            raise RuntimeError(f"{task.get_coro()} ended early")
        await asyncio.sleep(min(2.0, left))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from slipstream.utils.tiny_models import make_tiny_tokenizer

    with tempfile.TemporaryDirectory(prefix="slipstream-scale-") as tmp:
        tokenizer = make_tiny_tokenizer(tmp)
    rows = []
    for n in args.servers:
        _log(f"{n} servers ...")
        row = asyncio.run(_row(n, args, tokenizer))
        _log(json.dumps(row))
        rows.append(row)
    config = {
        k: getattr(args, k)
        for k in (
            "tokens_per_s", "median_tokens", "max_new_tokens", "concurrency", "consumers", "buckets",
            "warmup_s", "seconds", "partial_rollout", "servers_per_proc", "batch_per_server",
        )
    }  # fmt: skip
    config["samples_per_group"] = SAMPLES_PER_GROUP
    return {"rows": rows, "config": config}


def _parser() -> argparse.ArgumentParser:
    """``--max-new-tokens``, ``--concurrency`` and ``--partial-rollout`` are keys of the run config,
    generated from it under the bench's defaults; the rest size the simulated servers and trainers."""
    from slipstream.config import Config

    p = command_parser("slipstream bench scale", doc_paragraph(__doc__))
    p.add_argument("--servers", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SERVERS,
                   help="server counts, comma-separated (default 8,32,128,256)")  # fmt: skip
    p.add_argument("--tokens-per-s", type=float, default=4.0, help="decode rate of one request")
    p.add_argument("--median-tokens", type=int, default=24, help="median response length")
    add_key_option(p, Config, "rollout.sampling.max_new_tokens", default=64)
    add_key_option(p, Config, "rollout.max_concurrent_per_server", flags=["--concurrency"], default=4)
    p.add_argument("--batch-per-server", type=int, default=1, help="trainer.batch_groups per server")
    p.add_argument("--consumers", type=int, default=4, help="simulated trainers leasing and acking")
    p.add_argument("--buckets", type=int, default=2, help="update calls per server and push")
    add_key_option(p, Config, "async.partial_rollout", choices=["abort", "in_place"])
    p.add_argument("--servers-per-proc", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--profile", default="", help="directory for a cProfile of the controller per row")
    add_json_flag(p)
    p.add_argument("--role", default="controller", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--lease-groups", type=int, default=1, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.role == "trainers":
        asyncio.run(_trainers(args.address, args.consumers, args.lease_groups))
        return 0
    if args.role == "publisher":
        _publisher()
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        keys = ["servers", "groups_s", "queue_p50_us", "queue_p99_us", "fanout_s", "controller_cpu", "rss_mb"]
        print(" ".join(f"{k:>14}" for k in keys))
        for row in result["rows"]:
            print(" ".join(f"{row[k]!s:>14}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
