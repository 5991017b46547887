"""Start-up and shutdown of a run's parts: Ray and the placement, the queue, the inference servers, the
trainer ranks and the rollouter; :class:`~slipstream.pipeline.parts.Parts` holds their typed handles
(``pipeline/handles.py``) for the rest of the controller.

The start-up order is written once, in :meth:`Launcher.start_parts` (``Pipeline._start`` calls it after
:meth:`Launcher.connect`); every wait has a timeout (``cluster.*_timeout_s``). :meth:`Launcher.stop_all` stops
what was started, each stop with a timeout and then a kill, in the order that lets each part finish cleanly
(the rollouter before the servers it calls, the queue last).

Who owns what: the launcher creates actors and knows their constructor arguments (it alone reads the
whole config for them) and writes the handles into ``Parts``, each server through its pool
(``parts.servers.add``, ``serving``); the restart flow replaces a dead server's host through the pool (with
:meth:`Launcher.new_host`), the step driver writes the versions. Everyone else only calls the handles.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from slipstream.config import Config, ConfigError, rollouter_settings, trainer_settings
from slipstream.pipeline.actors import RolloutWorker, ServerHost, TrainerRank, wait_for_own_children
from slipstream.pipeline.cluster import Cluster, PartFailed, Pending, RayCluster, ask, first_line
from slipstream.pipeline.handles import QueueHandle, RolloutHandle, ServerHandle, TrainerGroup
from slipstream.pipeline.parts import Parts
from slipstream.pipeline.types import RankSetup, RolloutStart
from slipstream.planning.threads import plan_threads
from slipstream.rollouter.state import RolloutState
from slipstream.utils.http_auth import new_token
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class Launcher:
    """Creates the run's actors (module docstring). ``server_token`` guards the servers' control routes."""

    def __init__(self, cfg: Config, run_dir: Path, server_token: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.server_token = server_token
        self._cluster: Cluster | None = None
        self.ray_started = False
        # The judge servers' own token: the reward service holds it, and it controls no rollout server.
        self.judge_token = new_token()

    @property
    def cluster(self) -> Cluster:
        """The cluster the parts run on (after :meth:`connect`; tests set a fake one)."""
        if self._cluster is None:
            raise RuntimeError("Launcher.connect() first: no cluster yet")
        return self._cluster

    @cluster.setter
    def cluster(self, cluster: Cluster) -> None:
        self._cluster = cluster

    # ------------------------------------------------------------------ Ray and placement
    def connect(self, *, reap_if_killed: bool = False) -> Cluster:
        """Join or start Ray, check the pools and hosts, reserve every part; return the cluster."""
        import ray

        from slipstream.pipeline.placement import Placement, PlacementError

        self.ray_started = connect_ray(self.cfg)
        if self.ray_started and reap_if_killed:
            from slipstream.pipeline.reaper import start_reaper

            start_reaper()  # removes this run's processes if this driver is killed without cleaning up
        wait_for_own_children()  # Ray's subreaper setting made this driver ignore SIGCHLD
        check_pools(self.cfg, ray.cluster_resources())
        check_hosts(self.cfg, sum(1 for n in ray.nodes() if n.get("Alive")))
        try:
            placement = Placement.reserve(self.cfg)
        except PlacementError as err:
            raise PartFailed(f"placement: {err}") from None
        log.info("placement: %s", placement.summary())
        self.cluster = RayCluster(placement)
        return self.cluster

    # ------------------------------------------------------------------ the parts
    def start_parts(self, parts: Parts, resume: Path | None, state: RolloutState | None,
                    push: Callable[[int], object]) -> None:  # fmt: skip
        """Start every part, in this order (the one place it is written):

        1. the queue server, whose address goes to the ranks and the rollouter;
        2. the inference servers and the judge servers of ``reward.service.launch`` (they load meanwhile),
           and the rollouter's actor (its process imports meanwhile too);
        3. the trainer ranks: process group at rank 0's endpoint, engine, resume from ``resume`` (the
           queue restored from its snapshot);
        4. the servers' URLs (each answering ``/health``), then the judges', handed to rank 0's publisher;
        5. on resume (version > 0) a first ``push`` of that version: fresh servers serve the initial weights;
        6. the rollouter, from its saved ``state``, at the version the servers serve."""
        self.start_queue(parts)
        server_calls = self.launch_servers(parts)
        judge_calls = self.launch_judges(parts)
        self.create_rollouter(parts)
        self.start_trainer(parts, resume)
        if server_calls:
            urls = ask(self.cluster, server_calls, self.cfg.cluster.start_timeout_s, "inference servers")
            for index, url in enumerate(urls):
                parts.servers.serving(index, url)
        self.wait_judges(parts, judge_calls)
        parts.trainer.attach_servers(parts.servers.urls, self.server_token)
        if parts.version > 0:
            push(parts.version)
        self.start_rollouter(parts, state)

    def start_queue(self, parts: Parts) -> None:
        from slipstream.queue.client import QueueClient
        from slipstream.queue.server import QueueServerActor

        parts.queue = QueueHandle(self.cluster, self.cluster.spawn("queue", QueueServerActor, self.cfg.queue))
        parts.queue_address = parts.queue.address(self.cfg.cluster.start_timeout_s)
        parts.queue_client = QueueClient(parts.queue_address, shared_memory=False)

    def launch_servers(self, parts: Parts) -> list[Pending[str]]:
        """Start the server hosts; returns the calls that give their URLs (none for servers given by URL)."""
        if self.cfg.rollout.server_urls:
            for url in self.cfg.rollout.server_urls:
                parts.servers.add(None, url.rstrip("/"))
            return []
        for index in range(self.cfg.rollout.num_servers):
            parts.servers.add(self.new_host(index))
        return [h.start() for h in parts.servers.hosts()]

    def new_host(self, index: int) -> ServerHandle:
        """A server host actor for server ``index`` (not started: call its ``start``)."""
        cfg = self.cfg
        args = (
            cfg.rollout,
            cfg.cluster.server_host,
            index,
            cfg.model.path,
            str(self.run_dir),
            self.server_token,
        )
        actor = self.cluster.spawn(f"server{index}", ServerHost, *args)
        return ServerHandle(self.cluster, actor, f"server-{index}")

    def launch_judges(self, parts: Parts) -> list[Pending[str]]:
        """Start the judge servers of ``reward.service.launch`` (none unless a data source is scored by
        the service); returns the calls that give their URLs, for :meth:`wait_judges`.

        They are server hosts like the rollout servers', with a rollout section of their own (the judge's
        backend, server count and arguments over ``rollout``) and their own token, and they stay out of
        ``parts.servers``: the publisher and the balancer never hear of them, so no weight push and no rollout
        request reaches them (their restarts: ``judges.py``)."""
        from slipstream.pipeline.placement import judge_servers

        for index in range(judge_servers(self.cfg)):
            parts.judges.add(self.new_judge_host(index))
        return [h.start() for h in parts.judges.hosts()]

    def new_judge_host(self, index: int) -> ServerHandle:
        """A server host actor for judge server ``index`` (not started: call its ``start``)."""
        launch = self.cfg.reward.service.launch
        rollout = msgspec.structs.replace(
            self.cfg.rollout, backend=launch.backend, num_servers=launch.num_servers, server_urls=[],
            server_args=list(launch.server_args), launch_timeout_s=launch.launch_timeout_s,
            max_position_embeddings=launch.max_position_embeddings,
        )  # fmt: skip
        args = (rollout, self.cfg.cluster.server_host, index, launch.model_path, str(self.run_dir),
                self.judge_token, "judge")  # fmt: skip
        actor = self.cluster.spawn(f"judge{index}", ServerHost, *args)
        return ServerHandle(self.cluster, actor, f"judge-{index}")

    def wait_judges(self, parts: Parts, calls: list[Pending[str]]) -> None:
        if calls:
            urls = ask(self.cluster, calls, self.cfg.cluster.start_timeout_s, "judge servers")
            for index, url in enumerate(urls):
                parts.judges.serving(index, url)
            log.info("judge servers for reward.service: %s", ", ".join(parts.judges.urls))

    def start_trainer(self, parts: Parts, resume: Path | None) -> int:
        """New trainer ranks, joined and resumed from ``resume``; returns their version."""
        cfg, cluster = self.cfg, self.cluster
        world = cfg.trainer.num_ranks
        threads = plan_threads(cfg).trainer_threads  # 0 takes the cores the CPU servers leave
        # The controller writes checkpoints (with the rollouter's state), so the trainer's own are off.
        settings = msgspec.structs.replace(trainer_settings(cfg), checkpoint_every=0)
        ranks = [
            cluster.spawn(f"rank{r}", TrainerRank, settings, r, world, str(self.run_dir), threads)
            for r in range(world)
        ]
        parts.trainer = trainer = TrainerGroup(cluster, ranks)
        host, port = trainer.endpoint()
        setup = RankSetup(host, port, parts.queue_address, str(resume) if resume else None)
        parts.version = int(trainer.setup(setup, cfg.cluster.start_timeout_s)[0])
        return parts.version

    def create_rollouter(self, parts: Parts) -> None:
        settings = rollouter_settings(self.cfg)
        actor = self.cluster.spawn("rollouter", RolloutWorker, settings, str(self.run_dir))
        parts.rollouter = RolloutHandle(self.cluster, actor)

    def start_rollouter(self, parts: Parts, state: RolloutState | None) -> None:
        servers, judges = parts.servers.urls, parts.judges.urls
        start = RolloutStart(servers, parts.queue_address, parts.published, state, self.server_token, judges,
                             self.judge_token if judges else "")  # fmt: skip
        parts.rollouter.start(start, self.cfg.cluster.start_timeout_s)
        parts.rollouter_started = True

    # ------------------------------------------------------------------ shutdown
    def stop_all(self, parts: Parts) -> None:
        """Stop every part (each stop has ``cluster.shutdown_timeout_s``, then the actor is killed). Servers
        and judges that are down cannot answer ``stop`` while they start again (or wait for room): they are
        killed."""
        cluster, judges, servers = self._cluster, parts.judges, parts.servers
        if cluster is None:
            return

        def stopping(handles: list[Any]) -> tuple[list[Any], Callable[[], list[Pending[Any]]]]:
            return [h.actor for h in handles], lambda: [c for h in handles for c in h.stop()]

        def killing(handles: list[ServerHandle]) -> tuple[list[Any], None]:
            return [h.actor for h in handles], None

        trainer = parts.trainer
        steps = [
            ("rollouter", stopping([parts.rollouter] if parts.rollouter else [])),
            ("trainer", (list(trainer.ranks), trainer.stop) if trainer else ([], None)),
            ("servers", stopping(servers.hosts(down=False))),
            ("restarting servers", killing(servers.hosts(down=True))),
            ("judge servers", stopping(judges.hosts(down=False))),
            ("restarting judge servers", killing(judges.hosts(down=True))),
            ("queue", stopping([parts.queue] if parts.queue else [])),
        ]
        for name, (actors, stop) in steps:
            if not actors:
                continue
            try:
                if stop is not None:
                    cluster.get(stop(), self.cfg.cluster.shutdown_timeout_s)
            except Exception as err:
                log.warning("stopping the %s: %s; killing it", name, first_line(err))
            for actor in actors:
                cluster.kill(actor)
        if parts.queue_client:
            parts.queue_client.close()
        cluster.release()

    def disconnect(self) -> None:
        if self.ray_started:
            import ray

            ray.shutdown()


def connect_ray(cfg: Config) -> bool:
    """Join ``cluster.ray_address``, or start Ray on this machine with both pools sized from its GPUs;
    return whether this call started it (then the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    from slipstream.pipeline.placement import local_resources

    # Raylet then kills a crashed actor's child processes too (an inference server), within 10 s.
    os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "1")
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if cfg.cluster.ray_address is not None:
        send_ray_token_if_any()
    if cfg.cluster.ray_address is None:
        gpus = local_gpus()
        kwargs.update(num_gpus=gpus, resources=local_resources(cfg, gpus))
    # "local" starts a new instance: with no address, ray.init() would join any cluster that `ray start`
    # left running on this machine (and then refuse the pool resources).
    ray.init(address=cfg.cluster.ray_address or "local", **kwargs)
    return True


def send_ray_token_if_any() -> None:
    """Send this machine's Ray token when joining a cluster (as scripts/_ray_env.sh does for the nodes).

    A Ray head that finds a token (~/.ray/auth_token, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) requires it, but a
    driver joining it only sends one with RAY_AUTH_MODE=token, and fails with a bare "Failed to connect".
    RAY_AUTH_MODE set by hand wins."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    tokens = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    if any(os.environ.get(k) for k in tokens) or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def local_gpus() -> int:
    """GPUs this machine shows the run (CUDA_VISIBLE_DEVICES applies), 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_pools(cfg: Config, resources: dict[str, float]) -> None:
    """Both pool resources exist in the cluster (the launch scripts declare them)."""
    for key in ("rollout_resource", "trainer_resource"):
        name = getattr(cfg.cluster, key)
        if name not in resources:
            raise ConfigError(
                f"cluster.{key}: the Ray cluster has no `{name}` resource; start its nodes with "
                "scripts/launch_rollout_cluster.sh / scripts/launch_trainer_cluster.sh"
            )


def check_hosts(cfg: Config, nodes: int) -> None:
    """On two nodes or more no server may bind loopback: one error naming every key to change."""
    from slipstream.utils.net import is_loopback

    if nodes < 2:
        return
    keys = [
        f"{key}={host}"
        for key, host in (
            ("queue.host", cfg.queue.host),
            ("cluster.server_host", cfg.cluster.server_host),
            ("weightsync.master_address", cfg.weightsync.master_address),
        )
        if is_loopback(host)
    ]
    if keys:
        fix = " ".join(f"{k.split('=')[0]}=0.0.0.0" for k in keys)
        raise ConfigError(
            f"{', '.join(k.split('=')[0] for k in keys)}: loopback ({', '.join(keys)}) but the Ray cluster has "
            f"{nodes} nodes, so other nodes could not reach them; set {fix}"
        )


def install_sigterm(handler: Any) -> Any:
    """Make SIGTERM call ``handler()`` (after ``ray.init``, which installs a handler of its own); return
    the handler it replaces, to put back at shutdown."""
    return signal.signal(signal.SIGTERM, lambda signum, frame: handler())


__all__ = [
    "Launcher",
    "check_hosts",
    "check_pools",
    "connect_ray",
    "send_ray_token_if_any",
]
