"""The parts of a run as Ray actors: inference server hosts, the rollouter, the trainer ranks.

The controller (``pipeline/controller.py``) places these on the two node pools with Ray custom resources
(``cluster.rollout_resource`` / ``cluster.trainer_resource``) and talks to them only through method calls
whose arguments and results are the Structs of ``pipeline/types.py``; each part is built from its role's
settings (``trainer.settings.TrainerSettings``, ``rollouter.settings.RollouterSettings``; a server host
the ``rollout`` section), never the whole config. Control goes through Ray, data never does. Trajectories travel rollouter → queue → trainer over
ZeroMQ, weights trainer → servers over the checkpoint engine, requests rollouter → servers over HTTP.

* :class:`ServerHost` owns one inference server process on a rollout node (launched with
  ``rollouter.launch``); it can stop and start it again in place (same node, same GPUs, a new port).
* :class:`RolloutWorker` runs the :class:`~slipstream.rollouter.rollouter.Rollouter` on its own event loop
  (an async actor, so every call runs on the loop that runs the rollouter, as the rollouter requires).
* :class:`TrainerRank` is one SPMD trainer rank; rank 0 also owns the queue client and the
  :class:`~slipstream.weightsync.publisher.WeightPublisher`. It is a threaded actor (two calls at once) so
  that the controller can add a restarted server to the publisher while a step waits for data.

Each actor writes its log to ``<run_dir>/logs/<part>.log``.

The controller's server token (one per run) reaches each server process through its environment
(``$SLIPSTREAM_SERVER_TOKEN``, never its command line) and the rollouter and rank 0 as a call argument:
their clients send it on every request, so they alone can pause, abort and push weights.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from slipstream.pipeline.types import (
    PushReport,
    RankSetup,
    RolloutStart,
    RolloutStatus,
    ServerHealth,
    StepReport,
)
from slipstream.queue.base import Lease, QueueConsumer
from slipstream.rollouter.state import RolloutState
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.queue.client import QueueClient
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.rollouter.settings import RollouterSettings
    from slipstream.trainer.settings import TrainerSettings

log = get_logger(__name__)


def log_to_file(run_dir: str, name: str) -> None:
    """Send this process's `slipstream` logs to ``<run_dir>/logs/<name>.log`` as well."""
    path = Path(run_dir) / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(process)d %(name)s: %(message)s"))
    get_logger("slipstream").addHandler(handler)


def wait_for_own_children() -> None:
    """Give SIGCHLD its default action back in this process.

    Ray's child-process clean-up (``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper``, which
    the pipeline turns on so that a crashed actor's inference server dies with it) sets SIGCHLD to
    ``SIG_IGN`` in the driver and in every worker, at the C level. The kernel then reaps children at once
    and ``waitpid`` fails: ``subprocess`` reports exit code 0 for a server that failed, and
    ``multiprocessing`` joins see no exit code at all. Every process of the pipeline that starts children
    calls this first; the raylet still kills what a dead worker leaves behind. Through libc, because Ray
    runs an actor's constructor off the main thread, where ``signal.signal`` refuses to run (the
    disposition is per process either way, and Python's own record already says ``SIG_DFL``).
    """
    ctypes.CDLL(None).signal(int(signal.SIGCHLD), 0)  # 0 is SIG_DFL


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _advertised(host: str) -> str:
    """The address other nodes dial for a socket bound to ``host`` (the node's own for 0.0.0.0)."""
    return _node_ip() if host in ("0.0.0.0", "", "::") else host


# ------------------------------------------------------------------------------------------ servers
class ServerHost:
    """One inference server process. Lifecycle: ``start()`` → ``health()`` … → ``stop()``; ``start()``
    again restarts it (a new port, so a new URL). It holds the ``rollout`` section (the servers' own) and
    the address it binds (``cluster.server_host``). ``role`` names its logs: ``server`` for a rollout
    server, ``judge`` for a judge server of ``reward.service.launch`` (a rollout section of its own)."""

    max_concurrency: ClassVar[int] = 2  # health checks answer while start() waits for the server

    def __init__(
        self,
        rollout: RolloutConfig,
        server_host: str,
        index: int,
        model_path: str,
        run_dir: str,
        token: str = "",
        role: str = "server",
    ) -> None:
        log_to_file(run_dir, f"{role}-{index}")
        wait_for_own_children()
        self.rollout, self.server_host = rollout, server_host
        self.index = index
        self.model_path = model_path
        self.token = token
        prefix = "" if role == "server" else f"{role}-"
        self.log_path = Path(run_dir) / "logs" / f"{prefix}{rollout.backend}-{index}.log"
        self.server = None
        self.url = ""

    def start(self) -> str:
        """Launch the server and wait until it answers ``/health``; return its URL."""
        from slipstream.rollouter.launch import ServerLaunchError, launch_server
        from slipstream.serverkinds import server_kind
        from slipstream.utils.cpu import usable_cores
        from slipstream.utils.net import free_port

        self.stop()
        rollout, host = self.rollout, self.server_host
        # Ray sets OMP_NUM_THREADS=1 in actors that reserve no CPU; a server on a CPU gets its kind's count
        # (0: one per core), a GPU server its kind's own environment.
        kind = server_kind(rollout.backend)  # resolved here, at the root, and handed to the launcher
        threads = kind.cpu_threads(rollout)
        env = {"OMP_NUM_THREADS": str(threads or usable_cores())} if threads is not None else {}
        if self.token:
            from slipstream.utils.http_auth import TOKEN_ENV

            env[TOKEN_ENV] = self.token
        for attempt in range(3):
            # The port is probed on the address the server binds (0.0.0.0 covers every interface), and
            # another process may still take it before the server binds: then a new port is tried.
            port = free_port(host if host != "::" else "0.0.0.0")
            self.server = launch_server(kind, self.model_path, host=host, port=port, cfg=rollout,
                                        env=env, log_path=self.log_path)  # fmt: skip
            try:
                self.server.wait_healthy(rollout.launch_timeout_s)
                break
            except ServerLaunchError as err:
                if attempt == 2 or "address already in use" not in str(err).lower():
                    raise
                log.warning("server %d: port %d was taken before it bound; trying another", self.index, port)
        self.url = f"http://{_advertised(host)}:{port}"
        log.info("server %d serving at %s (pid %d)", self.index, self.url, self.server.pid)
        return self.url

    def health(self) -> ServerHealth:
        """Process state and one probe (2 s) of the kind's health route (``/health``)."""
        import httpx

        if self.server is None:
            return ServerHealth(alive=False, healthy=False)
        alive = self.server.is_alive()
        healthy = False
        if alive:
            health = self.server.health
            try:
                healthy = (
                    httpx.request(health.method, f"{self.url}{health.path}", timeout=2.0).status_code == 200
                )
            except httpx.HTTPError:
                healthy = False
        return ServerHealth(alive, healthy, self.server.popen.returncode, self.server.pid)

    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def log_tail(self, lines: int = 20) -> str:
        return self.server.log_tail(lines) if self.server is not None else ""

    def stop(self) -> int | None:
        if self.server is None:
            return None
        code = self.server.stop(timeout_s=15)
        self.server = None
        return code


# ------------------------------------------------------------------------------------------ rollouter
class _WaitForServers:
    """An inference client over the balancer: a request that finds no live server waits for one to be
    (re)added, up to ``patience_s``, instead of failing its group (a lone server being restarted)."""

    def __init__(self, balancer: Any, patience_s: float) -> None:
        self.balancer = balancer
        self.patience_s = patience_s

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None, **media):
        from slipstream.rollouter.balancer import NoServerAvailable

        deadline = None
        while True:
            try:
                return await self.balancer.generate(
                    input_ids, sampling, rid=rid, session_id=session_id, **media
                )
            except NoServerAvailable:
                deadline = deadline or time.monotonic() + self.patience_s
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)

    async def abort(self, rid: str) -> None:
        await self.balancer.abort(rid)

    async def abort_all(self) -> None:
        await self.balancer.abort_all()


class RolloutWorker:
    """The rollouter in its own process (async actor). Lifecycle: ``start`` → (``set_version``, ``drain``,
    ``metrics``, ``state_dict``, ``add_server``/``remove_server``, ``set_judge_urls``)* → ``stop``."""

    def __init__(self, settings: RollouterSettings, run_dir: str) -> None:
        log_to_file(run_dir, "rollouter")
        wait_for_own_children()
        self.settings = settings
        import slipstream.rollouter.rollouter  # noqa: F401  (imported while the other parts start)

        self.rollouter = None
        self.balancer = None
        self.queue = None
        self._task: asyncio.Task | None = None
        self._reviver: asyncio.Task | None = None
        self._token = ""
        from slipstream.serverkinds import server_kind

        self._kind = server_kind(settings.rollout.backend)  # the servers' kind, handed to their clients

    async def start(self, start: RolloutStart) -> None:
        import msgspec
        from transformers import AutoTokenizer

        from slipstream.agents.data import PromptSource
        from slipstream.queue.client import AsyncQueueClient
        from slipstream.rollouter.balancer import balancer_from_config
        from slipstream.rollouter.rollouter import Rollouter
        from slipstream.rollouter.server_stats import ServerStats

        cfg = self.settings
        tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code
        )
        prompts = PromptSource.from_config(cfg.data, seed=cfg.seed)
        if start.judge_urls:  # judge servers the run started: the reward service calls them
            service = msgspec.structs.replace(cfg.reward.service, urls=list(start.judge_urls))
            reward = msgspec.structs.replace(cfg.reward, service=service)
            cfg = self.settings = msgspec.structs.replace(cfg, reward=reward)
        self._token = start.token
        self.balancer = balancer_from_config(self._kind, cfg.rollout, start.urls, start.token)
        restarting = cfg.restart_servers and not cfg.rollout.server_urls
        patience = cfg.rollout.launch_timeout_s + 4 * cfg.health_interval_s if restarting else 0.0
        client = _WaitForServers(self.balancer, patience)
        self.queue = AsyncQueueClient(start.queue_address)
        stats = ServerStats(lambda: self.balancer.clients)  # each server's own counters: server/* metrics
        self.rollouter = Rollouter(cfg, client, self.queue, tokenizer, prompts, server_stats=stats)
        if start.judge_token:
            self.rollouter.set_judges(list(start.judge_urls), start.judge_token)
        if start.state is not None:
            self.rollouter.load_state_dict(start.state)
        self.rollouter.set_version(start.version)
        self._task = asyncio.create_task(self.rollouter.run(), name="rollouter")
        self._reviver = asyncio.create_task(self._revive_servers())

    async def status(self) -> RolloutStatus:
        """``done`` once every prompt is generated and put; ``error`` names a failure of the rollouter."""
        if self._task is None or not self._task.done():
            return RolloutStatus()
        err = None if self._task.cancelled() else self._task.exception()
        return RolloutStatus(done=True, error=None if err is None else f"{type(err).__name__}: {err}")

    async def set_version(self, version: int) -> None:
        self.rollouter.set_version(version)

    async def set_staleness_threshold(self, staleness_threshold: float) -> None:
        self.rollouter.set_staleness_threshold(staleness_threshold)

    async def drain(self) -> float:
        t0 = time.monotonic()
        await self.rollouter.drain()
        return time.monotonic() - t0

    async def metrics(self) -> dict[str, float]:
        return self.rollouter.metrics() if self.rollouter is not None else {}

    async def finish_eval(self, version: int) -> None:
        """Wait for the running evaluation, then evaluate ``version`` if it was not (the end of a run)."""
        await self.rollouter.finish_eval(version)

    async def state_dict(self) -> RolloutState:
        """The rollouter's state for a run checkpoint (``Rollouter.checkpoint_state``)."""
        return await self.rollouter.checkpoint_state()

    async def add_server(self, url: str) -> None:
        from slipstream.rollouter.clients import client_for

        self.balancer.add(client_for(self._kind, self.settings.rollout, url).authorize(self._token))

    async def set_judge_urls(self, urls: list[str]) -> None:
        """The judge servers the reward service calls from now on (one was restarted on a new port)."""
        self.rollouter.set_judges(urls)

    async def pid(self) -> int:
        return os.getpid()

    async def remove_server(self, url: str) -> None:
        client = self.balancer.remove(url)
        if client is not None:
            await client.aclose()

    async def stop(self) -> None:
        if self._reviver is not None:
            self._reviver.cancel()
        if self.rollouter is not None:
            await self.rollouter.stop()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.balancer is not None:
            await self.balancer.aclose()
        if self.queue is not None:
            await self.queue.close()

    async def _revive_servers(self) -> None:
        """A server the balancer marked dead after a transient error comes back once ``/health`` answers."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            if len(self.balancer.alive()) < len(self.balancer.clients):
                try:
                    await self.balancer.check_health()
                except Exception as err:  # a probe failing must not end the loop
                    log.warning("server health probe failed: %s", err)


# ------------------------------------------------------------------------------------------ trainer
class _TrackedQueue(QueueConsumer):
    """The trainer's queue client, plus two things the controller needs: the time spent waiting for
    batches (the trainer's idle time) and a file naming the leases held, so that after a crash the
    restarted rank 0 gives them back at once instead of waiting for their expiry. The trainer sees only
    the consumer side of the client (:class:`~slipstream.queue.base.QueueConsumer`)."""

    PARK_S = 0.05

    def __init__(self, client: QueueClient, lease_file: Path) -> None:
        self.client = client
        self.lease_file = lease_file
        self.wait_s = 0.0
        self._held: set[str] = set()

    def lease(
        self,
        n_groups: int,
        *,
        partition: str = "train",
        timeout_s: float | None = None,
        min_groups: int | None = None,
        consumer_version: int | None = None,
    ) -> Lease | None:
        """The client's lease, waiting in server-side parks of at most ``PARK_S`` (no sleeping: each park
        ends the moment groups are ready). Why: a lease request parked at the server outlives a consumer
        that dies, and groups arriving later are handed to the dead consumer, where they sit until the
        lease expires (``queue.lease_timeout_s``). Short parks shrink that window to ``PARK_S`` after the
        death; the cost is a few dozen round trips per second while the trainer waits."""
        t0 = time.monotonic()
        deadline = t0 + (timeout_s if timeout_s is not None else 60.0)
        try:
            while True:
                park = max(0.0, min(self.PARK_S, deadline - time.monotonic()))
                lease = self.client.lease(
                    n_groups,
                    partition=partition,
                    timeout_s=park,
                    min_groups=min_groups,
                    consumer_version=consumer_version,
                )
                if lease is not None or time.monotonic() >= deadline:
                    break
        finally:
            self.wait_s += time.monotonic() - t0
        if lease is not None:
            self._held.add(lease.lease_id)
            self._write()
        return lease

    def ack(self, lease: Lease | str, *, dropped: Sequence[str] = ()) -> None:
        self.client.ack(lease, dropped=dropped)
        self._forget(lease)

    def nack(self, lease: Lease | str) -> None:
        self.client.nack(lease)
        self._forget(lease)

    def snapshot(self, name: str) -> dict:
        return self.client.snapshot(name)

    def restore(self, name: str) -> dict:
        return self.client.restore(name)

    def release_stale_leases(self) -> int:
        """Nack the leases a previous rank 0 held when it died (unknown or expired ones are skipped)."""
        from slipstream.queue.ops import QueueError

        if not self.lease_file.is_file():
            return 0
        released = 0
        for lease_id in json.loads(self.lease_file.read_text() or "[]"):
            try:
                self.client.nack(lease_id)
                released += 1
            except QueueError as err:
                log.info("lease %s of the previous trainer is already gone: %s", lease_id, err)
        self.lease_file.unlink()
        return released

    def _forget(self, lease: Lease | str) -> None:
        self._held.discard(lease if isinstance(lease, str) else lease.lease_id)
        self._write()

    def _write(self) -> None:
        tmp = self.lease_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self._held)))
        tmp.replace(self.lease_file)


def _lease_owner(run_dir: Path) -> bytes:
    """Rank 0's queue secret, the same for every rank 0 of this run: the queue binds leases to it, and a
    restarted rank 0 must be able to give back the leases of the one that died (release_stale_leases)."""
    key = run_dir / "trainer_queue_owner"
    if not key.is_file():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(16))
        finally:
            os.close(fd)
    return key.read_bytes()


class TrainerRank:
    """One trainer rank. Lifecycle: ``endpoint`` (rank 0) → ``setup`` on every rank at once → (``step``,
    ``publish``, ``save``)* on every rank at once → ``close``. ``add_server``/``remove_server`` (rank 0)
    may run during a step."""

    max_concurrency: ClassVar[int] = 2  # add_server / remove_server during a step

    def __init__(
        self, settings: TrainerSettings, rank: int, world_size: int, run_dir: str, threads: int
    ) -> None:
        log_to_file(run_dir, f"trainer-{rank}")
        wait_for_own_children()
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.run_dir = Path(run_dir)
        self.threads = threads
        self.trainer = None
        self.engine = None
        self.queue: _TrackedQueue | None = None
        self.publisher = None
        import slipstream.trainer.trainer  # noqa: F401  (torch: imported while the servers load)

    def endpoint(self) -> tuple[str, int]:
        """(address, free port) for the trainers' process-group rendezvous, on this node."""
        from slipstream.utils.net import free_port

        host = "127.0.0.1" if self.world_size == 1 else _node_ip()
        return host, free_port(host)

    def setup(self, setup: RankSetup) -> int:
        """Join the group, build the engine (rank 0: the queue client), resume; return the version."""
        from slipstream.queue.client import QueueClient
        from slipstream.trainer.launch import build_rank

        self._threads()
        if self.rank == 0:
            client = QueueClient(setup.queue_address, owner=_lease_owner(self.run_dir))
            self.queue = _TrackedQueue(client, self.run_dir / "trainer_leases.json")
        self.trainer = build_rank(
            self.settings, self.rank, self.world_size, setup.master_host, setup.master_port, self.queue
        )
        self.engine = self.trainer.engine
        if setup.resume_path is not None:
            if self.queue is not None:
                released = self.queue.release_stale_leases()
                if released:
                    log.info("gave back %d leases the previous trainer held", released)
            self.trainer.resume(setup.resume_path)
            log.info(
                "rank %d resumed from %s at version %d", self.rank, setup.resume_path, self.trainer.version
            )
        return self.trainer.version

    def attach_servers(self, server_urls: list[str], token: str = "") -> None:
        """Rank 0: the publisher that pushes versions to ``server_urls`` (after ``setup``, once they serve),
        presenting the servers' ``token``."""
        import msgspec

        from slipstream.serverkinds import server_kind
        from slipstream.weightsync.publisher import WeightPublisher

        if self.rank != 0:
            return
        ws = self.settings.weightsync
        if ws.master_address in ("0.0.0.0", "", "::"):  # bind (and advertise) this node's address
            ws = msgspec.structs.replace(ws, master_address=_node_ip())
        kind = server_kind(self.settings.server_kind)
        self.publisher = WeightPublisher(ws, server_urls, kind, token=token)

    def pid(self) -> int:
        return os.getpid()

    def step(self) -> StepReport:
        """One trainer step; rank 0's report also names the samples trained and the time it waited for them."""
        self._threads()
        if self.queue is not None:
            self.queue.wait_s = 0.0
        metrics = {k: float(v) for k, v in self.trainer.step().items()}
        if self.rank != 0:
            return StepReport(version=self.trainer.version, metrics=metrics)
        uids = list(self.trainer.last_batch_uids)
        return StepReport(self.trainer.version, metrics, uids, self.queue.wait_s)

    def publish(self, version: int) -> PushReport:
        """Push the current weights as ``version`` (rank 0 sends; the others drive the all-gathers):
        ``Trainer.push``, as a standalone trainer does every sync_every steps."""
        self._threads()
        t0 = time.monotonic()
        report = self.trainer.push(self.publisher, version)
        return PushReport(report, time.monotonic() - t0) if report is not None else PushReport()

    def save(self, path: str) -> None:
        self._threads()
        self.trainer.save(path)

    def add_server(self, url: str) -> PushReport:
        """Rank 0: bring a restarted server to the last pushed version (``publish`` None: no kept copy yet)."""
        t0 = time.monotonic()
        report = self.publisher.add_server(url)
        return PushReport(report, time.monotonic() - t0)

    def remove_server(self, url: str) -> None:
        self.publisher.remove_server(url)

    def close(self) -> None:
        import torch.distributed as dist

        if self.publisher is not None:
            self.publisher.close()
        if self.queue is not None:
            self.queue.client.close()
            self.queue.lease_file.unlink(missing_ok=True)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _threads(self) -> None:
        # Per call: Ray runs a threaded actor's methods on pool threads, and OpenMP's thread count is
        # per calling thread.
        if self.threads > 0:
            import torch

            torch.set_num_threads(self.threads)
