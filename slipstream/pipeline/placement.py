"""Where every part of a run goes: the pools reserved as Ray placement groups before any model loads.

Why placement groups (verl's resource pools do the same): an actor that asks Ray for resources the cluster
does not have waits forever, silently, and the run only fails at the first timeout that happens to cover
it. Reserving every GPU part at once, first, turns "it never started" into an error within
``cluster.placement_timeout_s`` (at once when the cluster's totals cannot hold the config) that names what
was asked for and what the cluster has; once the reservation holds, every actor lands in its bundle at once.

Pools, one placement group each (``PACK``: ranks and servers on as few nodes as possible):

==========  =================================================  ==========================================
group       one bundle per                                      bundle
==========  =================================================  ==========================================
trainer     trainer rank                                        ``{GPU: g, trainer_pool: g}``
rollout     inference server (none with ``rollout.server_urls``) ``{GPU: g, rollout_pool: g}``
            and judge server (``reward.service.launch``)         ``{GPU: j, rollout_pool: j}``
colocated   GPU shared by rank i and server i (``cluster.colocate``) ``{GPU: 1, trainer_pool: 1, rollout_pool: 1}``
==========  =================================================  ==========================================

``g`` is ``cluster.gpus_per_trainer_rank`` / ``cluster.gpus_per_server``, ``j`` the judge servers' own
(``reward.service.launch.gpus_per_server``, by default ``g``; with ``cluster.colocate`` too the judges keep
GPUs of their own); a CPU part (``g = 0``) takes a
sliver (0.01) of a pool unit so that it still lands on a node of its pool. Pool units count GPUs on GPU
nodes (``scripts/_ray_node.sh``), so only GPU parts use them up. The CPU-only parts, the queue server and
the rollouter (with its reward workers), reserve nothing: they are pinned by node affinity to the node of
their pool's first bundle (or, with servers given by URL, to a node of the rollout pool).

Worked example, a one-GPU machine (``cluster.colocate=true``, one rank, one server)::

    placement = Placement.reserve(cfg)            # raises PlacementError naming the shortfall
    placement.options("rank0")   # {'num_cpus': 0, 'num_gpus': 0.5, 'resources': {'trainer_pool': 1.0},
                                 #  'scheduling_strategy': PlacementGroupSchedulingStrategy(...)}
    placement.layout()           # [Slot('rank0', 'trainer', node, 0.5), Slot('server0', ...), ...]
    placement.release()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slipstream.config import Config, ConfigError

SLIVER = 0.01  # pool units a CPU-only rank or server takes (a CPU node has one unit per pool)


class PlacementError(RuntimeError):
    """The cluster cannot hold the config; the message names the parts left out and what the nodes have."""


@dataclass(frozen=True)
class Part:
    """One actor of the run. ``group`` is its placement group (None: a CPU-only part pinned to a node) and
    ``demand`` what it asks of its bundle."""

    name: str
    pool: str  # "trainer" | "rollout"
    group: str | None
    bundle: int
    demand: dict[str, float]

    @property
    def gpus(self) -> float:
        return self.demand.get("GPU", 0.0)


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    resources: dict[str, float]  # totals


@dataclass(frozen=True)
class Slot:
    """Where one part landed (``slipstream train --check-placement`` prints these)."""

    part: str
    pool: str
    node_id: str
    address: str
    gpus: float


# ------------------------------------------------------------------------------------------ the plan
def check_layout(cfg: Config) -> None:
    """Config rules of the layout itself (``cluster.colocate``); raise ConfigError naming the key."""
    c = cfg.cluster
    if not c.colocate:
        return
    if c.gpus_per_server != 1 or c.gpus_per_trainer_rank != 1:
        raise ConfigError(
            "cluster.colocate: a rank and a server share one GPU; set cluster.gpus_per_server=1 and "
            f"cluster.gpus_per_trainer_rank=1 (they are {c.gpus_per_server} and {c.gpus_per_trainer_rank})"
        )
    if cfg.rollout.server_urls:
        raise ConfigError("cluster.colocate: servers given by rollout.server_urls run elsewhere; turn it off")
    if cfg.rollout.num_servers > cfg.trainer.num_ranks:
        raise ConfigError(
            f"cluster.colocate: {cfg.rollout.num_servers} servers cannot share the GPUs of "
            f"{cfg.trainer.num_ranks} trainer ranks; set rollout.num_servers <= trainer.num_ranks"
        )
    _check_colocated_transport(cfg)


def _check_colocated_transport(cfg: Config) -> None:
    """A colocated server must be reachable by a weight transport that works on one GPU (the server kind's
    ``colocated_transports``; NCCL refuses two ranks on one GPU, "Duplicate GPU detected", so torch_dist/naive
    on CUDA never can)."""
    from slipstream.serverkinds import server_kind

    backend, transport = cfg.rollout.backend, cfg.weightsync.backend
    if transport in ("torch_dist", "naive") and cfg.weightsync.device == "cpu":
        return  # gloo through host memory: slow, but two processes on one GPU are no problem for it
    kind = server_kind(backend)
    allowed = kind.colocated_transports
    if not allowed:
        raise ConfigError(
            f"cluster.colocate: `{backend}` servers have no weight transport that works on one GPU shared with "
            f"the trainer: NCCL (weightsync.backend={transport}) refuses two ranks on one GPU and ipc/nixl "
            f"reach embedded servers only. Missing: {kind.colocated_missing or 'a one-GPU transport'}. "
            "Use rollout.backend=embedded, or give the servers GPUs of their own (cluster.colocate=false)"
        )
    if transport not in allowed:
        raise ConfigError(
            f"weightsync.backend: `{transport}` cannot push to a server on the trainer's own GPU (NCCL refuses "
            f"two ranks on one GPU); with cluster.colocate set weightsync.backend to one of {', '.join(allowed)} "
            "(ipc: CUDA IPC, the fast one)"
        )


def plan(cfg: Config) -> tuple[dict[str, list[dict[str, float]]], list[Part]]:
    """The bundles of every placement group, and every part with its place in them."""
    check_layout(cfg)
    c = cfg.cluster
    trainer, rollout = c.trainer_resource, c.rollout_resource
    ranks, servers = cfg.trainer.num_ranks, 0 if cfg.rollout.server_urls else cfg.rollout.num_servers
    groups: dict[str, list[dict[str, float]]] = {}
    parts: list[Part] = []
    if c.colocate:
        groups["colocated"] = [{"GPU": 1.0, trainer: 1.0, rollout: 1.0}] * ranks
        parts += [
            Part(f"rank{i}", "trainer", "colocated", i, {"GPU": 0.5, trainer: 1.0}) for i in range(ranks)
        ]
        parts += [
            Part(f"server{i}", "rollout", "colocated", i, {"GPU": 0.5, rollout: 1.0}) for i in range(servers)
        ]
    else:
        groups["trainer"] = [_bundle(c.gpus_per_trainer_rank, trainer)] * ranks
        parts += [Part(f"rank{i}", "trainer", "trainer", i, groups["trainer"][i]) for i in range(ranks)]
        if servers:
            groups["rollout"] = [_bundle(c.gpus_per_server, rollout)] * servers
            parts += [
                Part(f"server{i}", "rollout", "rollout", i, groups["rollout"][i]) for i in range(servers)
            ]
    judges = judge_servers(cfg)
    if judges:  # the judge pool: bundles of the rollout pool, after the rollout servers'
        bundle = _bundle(judge_gpus(cfg), rollout)
        first = len(groups.get("rollout", []))
        groups["rollout"] = [*groups.get("rollout", []), *[bundle] * judges]
        parts += [Part(f"judge{i}", "rollout", "rollout", first + i, bundle) for i in range(judges)]
    parts += [Part("queue", "trainer", None, 0, {}), Part("rollouter", "rollout", None, 0, {})]
    return groups, parts


def judge_servers(cfg: Config) -> int:
    """Judge servers the run starts (``reward.service.launch``): none unless a data source is scored by the
    service and the launch names a model."""
    from slipstream.agents.rewards import SERVICE_REWARD

    launch = cfg.reward.service.launch
    used = SERVICE_REWARD in cfg.reward.sources.values()
    return launch.num_servers if used and launch.model_path else 0


def judge_gpus(cfg: Config) -> int:
    gpus = cfg.reward.service.launch.gpus_per_server
    return cfg.cluster.gpus_per_server if gpus is None else gpus


def _bundle(gpus: int, pool: str) -> dict[str, float]:
    return {"GPU": float(gpus), pool: float(gpus)} if gpus else {pool: SLIVER}


# ------------------------------------------------------------------------------------------ fitting
def fit(groups: dict[str, list[dict[str, float]]], nodes: Iterable[Node]) -> dict[str, list[str | None]]:
    """Assign bundles to nodes' totals, largest first (None: no node left for it).

    What Ray's own scheduler will do with the placement groups, computed up front so that a config the
    cluster can never hold fails at once with the parts that do not fit, instead of waiting."""
    free = {n.node_id: dict(n.resources) for n in nodes}
    out: dict[str, list[str | None]] = {g: [None] * len(b) for g, b in groups.items()}
    order = sorted(
        ((g, i, b) for g, bundles in groups.items() for i, b in enumerate(bundles)),
        key=lambda item: -sum(item[2].values()),
    )
    for group, index, bundle in order:
        node = _first_fit(bundle, free, prefer=[n for n in out[group] if n is not None])
        if node is not None:
            for key, amount in bundle.items():
                free[node][key] = free[node].get(key, 0.0) - amount
            out[group][index] = node
    return out


def _first_fit(bundle: dict[str, float], free: dict[str, dict[str, float]], prefer: list[str]) -> str | None:
    # Nodes this group already uses first: PACK keeps a pool's parts together.
    candidates = list(dict.fromkeys([*prefer, *free]))
    for node in candidates:
        if all(free[node].get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()):
            return node
    return None


def shortfall(
    cfg: Config, parts: list[Part], nodes: list[Node], assigned: dict[str, list[str | None]]
) -> str:
    """A message naming the parts that do not fit, what each asks for, and what every node of the pools has."""
    reserved = [p for p in parts if p.group is not None]
    missing = [p for p in reserved if assigned[p.group][p.bundle] is None]  # type: ignore[index]
    by_ask: dict[str, list[str]] = {}
    for part in missing:
        by_ask.setdefault(_fmt(_group_bundle(cfg, part)), []).append(part.name)
    asks = "; ".join(
        f"{_names(names)} {'needs' if len(names) == 1 else 'need'} {ask}{'' if len(names) == 1 else ' each'}"
        for ask, names in by_ask.items()
    )
    pools = (cfg.cluster.trainer_resource, cfg.cluster.rollout_resource)
    have = [f"{n.address} [{n.node_id[:8]}] {_fmt(_pool_view(cfg, n.resources))}" for n in nodes
            if any(k in n.resources for k in pools)]  # fmt: skip
    judges = " or reward.service.launch.num_servers / gpus_per_server" if judge_servers(cfg) else ""
    one_gpu_node = len(nodes) == 1 and nodes[0].resources.get("GPU", 0) >= 1
    hint = (
        "; on one machine, cluster.colocate=true lets trainer ranks and servers share its GPUs"
        if one_gpu_node and not cfg.cluster.colocate
        else ""
    )
    return (
        f"the cluster cannot hold this config: {len(missing)} of {len(reserved)} reserved parts do not fit "
        f"({asks}). The config needs {_totals(cfg)} in all; nodes of the pools: {', '.join(have) or 'none'}. "
        "Add nodes (scripts/launch_*_cluster.sh) or lower trainer.num_ranks, rollout.num_servers, "
        f"cluster.gpus_per_trainer_rank or cluster.gpus_per_server{judges}{hint}"
    )


def _group_bundle(cfg: Config, part: Part) -> dict[str, float]:
    return plan(cfg)[0][part.group][part.bundle]  # type: ignore[index]


def _totals(cfg: Config) -> str:
    groups, _ = plan(cfg)
    total: dict[str, float] = {}
    for bundles in groups.values():
        for bundle in bundles:
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + amount
    return _fmt(total)


def _fmt(resources: dict[str, float]) -> str:
    items = sorted(resources.items(), key=lambda kv: (kv[0] != "GPU", kv[0]))
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in items) + "}"


def _names(names: list[str]) -> str:
    return (
        ", ".join(names)
        if len(names) <= 4
        else f"{', '.join(names[:2])} ... {names[-1]} ({len(names)} parts)"
    )


# ------------------------------------------------------------------------------------------ Ray
def cluster_nodes() -> list[Node]:
    import ray

    return [
        Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def local_resources(cfg: Config, gpus: int) -> dict[str, float]:
    """Pool units of a Ray started on this machine for one run: both pools live here, each with one unit per
    GPU (one on a CPU machine), so the GPUs are what limits the layout, as on a cluster."""
    units = float(max(gpus, 1))
    return {cfg.cluster.rollout_resource: units, cfg.cluster.trainer_resource: units}


class Placement:
    """The pools of one run, reserved. Lifecycle: :meth:`reserve` → :meth:`options` per actor (as often as
    parts restart) → :meth:`release` (the run's end; actors in the groups must be gone or going)."""

    def __init__(self, cfg: Config, parts: list[Part], pgs: dict[str, Any], nodes: list[Node]) -> None:
        self.cfg = cfg
        self.parts = {p.name: p for p in parts}
        self.pgs = pgs
        self.nodes = {n.node_id: n for n in nodes}
        self._pinned: dict[str, str] = {}
        self.first_layout: list[Slot] = []  # where every part landed at the start (node-loss reports)

    @classmethod
    def reserve(cls, cfg: Config, timeout_s: float | None = None) -> Placement:
        """Reserve every pool; raise PlacementError at once when the cluster's totals cannot hold them, and
        after ``timeout_s`` (default ``cluster.placement_timeout_s``) when other work holds what is needed."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        groups, parts = plan(cfg)
        nodes = cluster_nodes()
        assigned = fit(groups, nodes)
        if any(node is None for placed in assigned.values() for node in placed):
            raise PlacementError(shortfall(cfg, parts, nodes, assigned))
        pgs = {name: placement_group(bundles, strategy="PACK") for name, bundles in groups.items()}
        timeout_s = cfg.cluster.placement_timeout_s if timeout_s is None else timeout_s
        try:
            ray.get([pg.ready() for pg in pgs.values()], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in pgs.values():
                remove_placement_group(pg)
            raise PlacementError(
                f"the pools were not reserved within cluster.placement_timeout_s={timeout_s:g} s although the "
                f"cluster's totals hold them: other work holds resources (the config needs {_totals(cfg)}; "
                f"free now: {_fmt(_pool_view(cfg, ray.available_resources()))})"
            ) from None
        placement = cls(cfg, parts, pgs, nodes)
        placement._pin_cpu_parts()
        placement.first_layout = placement.layout()
        return placement

    def options(self, name: str, **extra: Any) -> dict[str, Any]:
        """Ray actor options that put part ``name`` (``rank3``, ``server0``, ``judge0``, ``queue``,
        ``rollouter``) in place."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        part = self.parts[name]
        if part.group is None:
            strategy: Any = NodeAffinitySchedulingStrategy(self._pinned[name], soft=False)
            return {"num_cpus": 0, "scheduling_strategy": strategy, **extra}
        strategy = PlacementGroupSchedulingStrategy(
            self.pgs[part.group], placement_group_bundle_index=part.bundle
        )
        resources = {k: v for k, v in part.demand.items() if k != "GPU"}
        return {"num_cpus": 0, "num_gpus": part.gpus, "resources": resources, "scheduling_strategy": strategy,
                **extra}  # fmt: skip

    def layout(self) -> list[Slot]:
        slots = []
        for part in self.parts.values():
            node_id = self._pinned[part.name] if part.group is None else self._bundle_node(part)
            node = self.nodes.get(node_id)
            slots.append(Slot(part.name, part.pool, node_id, node.address if node else "?", part.gpus))
        return slots

    def lost_nodes(self) -> dict[str, list[str]]:
        """Nodes of this run's first layout that Ray no longer lists alive: ``{"ADDR [node]": [parts]}``."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        lost: dict[str, list[str]] = {}
        for slot in self.first_layout:
            if slot.node_id not in alive:
                lost.setdefault(f"{slot.address} [{slot.node_id[:8]}]", []).append(slot.part)
        return lost

    def has_room(self, name: str) -> bool:
        """Whether part ``name``'s bundle is placed (False while Ray looks for room after its node died)."""
        import ray
        from ray.util.placement_group import placement_group_table

        part = self.parts[name]
        if part.group is None:
            return True
        node = placement_group_table(self.pgs[part.group]).get("bundles_to_node_id", {}).get(part.bundle)
        return node is not None and node in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def summary(self) -> str:
        """One line: the parts on each node (``127.0.0.1 [1a2b3c4d]: rank0, queue; ...``)."""
        nodes: dict[str, list[str]] = {}
        for slot in self.layout():
            nodes.setdefault(f"{slot.address} [{slot.node_id[:8]}]", []).append(slot.part)
        return "; ".join(f"{node}: {_names(parts)}" for node, parts in nodes.items())

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # Ray already shut down, or the group is gone
                pass
        self.pgs = {}

    def _bundle_node(self, part: Part) -> str:
        from ray.util.placement_group import placement_group_table

        return placement_group_table(self.pgs[part.group])["bundles_to_node_id"][part.bundle]

    def _pin_cpu_parts(self) -> None:
        for name in ("queue", "rollouter"):
            part = self.parts[name]
            anchor = next((p for p in self.parts.values() if p.pool == part.pool and p.group), None)
            if anchor is not None:
                self._pinned[name] = self._bundle_node(anchor)
                continue
            pool = getattr(self.cfg.cluster, f"{part.pool}_resource")
            nodes = [n for n in self.nodes.values() if n.resources.get(pool, 0) > 0]
            if not nodes:
                raise PlacementError(f"no node of the Ray cluster has the `{pool}` resource for the {name}")
            self._pinned[name] = nodes[0].node_id


def _pool_view(cfg: Config, resources: dict[str, float]) -> dict[str, float]:
    keys = ("GPU", cfg.cluster.trainer_resource, cfg.cluster.rollout_resource)
    return {k: float(resources.get(k, 0.0)) for k in keys}


def format_layout(slots: list[Slot]) -> str:
    """The table ``--check-placement`` prints: one line per part, then GPUs per node."""
    width = max(len(s.part) for s in slots)
    lines = [f"{'part'.ljust(width)}  {'pool':8} {'node':28} GPUs"]
    for s in slots:
        node = f"{s.address} [{s.node_id[:8]}]"
        lines.append(f"{s.part.ljust(width)}  {s.pool:8} {node:28} {s.gpus:g}")
    per_node: dict[str, float] = {}
    for s in slots:
        key = f"{s.address} [{s.node_id[:8]}]"
        per_node[key] = per_node.get(key, 0.0) + s.gpus
    lines.append(f"{len(slots)} parts on {len(per_node)} nodes: " + ", ".join(
        f"{node} {gpus:g} GPUs" for node, gpus in per_node.items()))  # fmt: skip
    return "\n".join(lines)


__all__ = [
    "Node", "Part", "Placement", "PlacementError", "Slot", "check_layout", "cluster_nodes", "fit",
    "format_layout", "judge_gpus", "judge_servers", "local_resources", "plan", "shortfall",
]  # fmt: skip
