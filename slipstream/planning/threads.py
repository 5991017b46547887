"""The CPU split: how many compute threads each part of a run on one machine takes, planned from its cores.

On a CPU machine every part competes for the same cores: each inference server's engine (its kind's
``cpu_threads``: ``rollout.embedded.num_threads``, ``rollout.vllm.cpu_threads``) and each trainer rank's torch
(``cluster.trainer_threads``). The queue, the rollouter, the controller and the reward workers are IO and
bookkeeping, a small share of one core, so the plan does not count them. When the compute threads add up to
more than the cores, the parts take turns on them: every thread of a torch or OpenMP parallel region waits
for the slowest, so an oversubscribed split runs slower than a smaller one (on the 2-core machine a vLLM
thread beside two trainer threads made the trainer wait on generation; docs/benchmarks.md, "CPU split").

What the plan decides: a ``0`` (one per core) is resolved against what the other parts take. Servers with
``0`` get the cores; trainer ranks with ``cluster.trainer_threads: 0`` share the cores the launched CPU servers
leave (at least one thread each). In ``sync`` mode generation and training take turns, so each may use every
core and the trainer ranks share them all. It applies only where the run starts every part on this machine (no
``cluster.ray_address``); a GPU server or trainer takes no CPU compute threads here.

Example::

    plan = plan_threads(cfg, cores=2)      # the quickstart: one vLLM thread, one trainer thread
    plan.trainer_threads                   # 1
    plan.warnings()                        # [] (2 threads on 2 cores)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.config import Config
from slipstream.serverkinds import server_kind
from slipstream.utils.cpu import usable_cores


@dataclass(frozen=True)
class Share:
    """One part's compute threads and the key that sets them."""

    part: str
    threads: int
    key: str


@dataclass(frozen=True)
class ThreadPlan:
    """The compute threads of every part that runs on this machine's CPU (module docstring)."""

    cores: int
    shares: list[Share] = field(default_factory=list)
    trainer_threads: int = 1
    """What each CPU trainer rank runs (``cluster.trainer_threads``, its 0 resolved)."""
    local: bool = True
    """Whether every part runs on this machine (no ``cluster.ray_address``): only then do they compete."""
    overlap: bool = True
    """Whether generation and training run at the same time (every mode but ``sync``, which alternates them:
    then each part may take every core, and only a part asking for more than there are is a problem)."""

    @property
    def total(self) -> int:
        if not self.overlap:
            return max((s.threads for s in self.shares), default=0)
        return sum(s.threads for s in self.shares)

    def warnings(self) -> list[str]:
        """One line when the parts ask for more compute threads than there are cores, naming the keys."""
        if not self.local or self.total <= self.cores:
            return []
        if not self.overlap:
            asks = ", ".join(f"{s.part} {s.threads} ({s.key})" for s in self.shares if s.threads > self.cores)
            return [f"{asks}: more threads than the {self.cores} cores; lower them to at most {self.cores}"]
        asks = ", ".join(f"{s.part} {s.threads} ({s.key})" for s in self.shares)
        return [
            f"the parts ask for {self.total} compute threads on {self.cores} cores: {asks}. They will take "
            "turns on the cores and each run slower; lower those keys so that they add up to at most "
            f"{self.cores} (0 for cluster.trainer_threads takes the cores the servers leave)"
        ]

    def describe(self) -> str:
        parts = ", ".join(f"{s.part} {s.threads}" for s in self.shares) or "nothing on the CPU"
        return f"CPU split on {self.cores} cores: {parts}"


def plan_threads(cfg: Config, cores: int | None = None) -> ThreadPlan:
    """The plan for ``cfg`` on a machine of ``cores`` cores (default: the ones this process may use)."""
    cores = cores or usable_cores()
    local = not cfg.cluster.ray_address
    shares: list[Share] = []
    kind = server_kind(cfg.rollout.backend)
    per_server = kind.cpu_threads(cfg.rollout)
    if per_server is not None and not cfg.rollout.server_urls:
        for i in range(cfg.rollout.num_servers):
            shares.append(
                Share(f"{kind.title or kind.name} server {i}", per_server or cores, kind.cpu_threads_key)
            )
    world = cfg.trainer.num_ranks
    overlap = cfg.async_.mode != "sync"
    trainer = cfg.cluster.trainer_threads
    if not trainer:
        left = cores - sum(s.threads for s in shares) if local and overlap else cores
        trainer = max(1, left // world)
    if cfg.trainer.device == "cpu":
        shares += [Share(f"trainer rank {r}", trainer, "cluster.trainer_threads") for r in range(world)]
    return ThreadPlan(cores=cores, shares=shares, trainer_threads=trainer, local=local, overlap=overlap)


__all__ = ["Share", "ThreadPlan", "plan_threads"]
