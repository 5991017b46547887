"""What the rollouter is built from: its own config sections plus the few values it takes from other roles.

The rollouter owns the sections of what it runs (``rollout``: servers and sampling, ``data``, ``agent``,
``reward``, ``eval``) and the shared ``model``; from other roles it needs the admission budget (the
``async`` knobs and ``trainer.batch_groups``), the queue's put timeout and how the pipeline watches servers.
The rollouter never sees the root config: :func:`slipstream.config.rollouter_settings` builds this struct
from it, field by field (tested in tests/rollouter/test_rollouter_settings.py), and the pipeline hands the
rollouter's actor the struct (msgspec Structs travel through Ray), never the whole config.

Worked example::

    settings = rollouter_settings(load_config("configs/quickstart.yaml"))   # slipstream.config
    settings.batch_groups                # trainer.batch_groups
    rollouter = Rollouter(settings, balancer, queue, tokenizer, PromptSource.from_config(settings.data))
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.agents.config import AgentConfig, DataConfig, RewardConfig
from slipstream.config_base import ModelConfig
from slipstream.rollouter.config import EvalConfig, RolloutConfig


class RollouterSettings(msgspec.Struct, kw_only=True):
    """The rollouter's config: its sections, and named values from other roles (the root key each comes from
    is in :func:`slipstream.config.rollouter_settings`). The ``async`` values hold their mode's preset."""

    rollout: RolloutConfig
    data: DataConfig
    agent: AgentConfig
    reward: RewardConfig
    eval_: EvalConfig = msgspec.field(name="eval")
    model: ModelConfig
    seed: int
    """Seeds the prompt order (``data.shuffle``)."""
    mode: Literal["sync", "one_step_off", "fully_async"]
    staleness_threshold: Annotated[float, Meta(ge=0)]
    sync_every: Annotated[int, Meta(ge=1)]
    stale_policy: Literal["drop", "keep"]
    max_stale_drops: Annotated[int, Meta(ge=0)]
    """Drops of one prompt after which its next group is marked ``keep_stale``."""
    batch_groups: Annotated[int, Meta(ge=1)]
    """Groups per trainer step: the unit of the admission budget."""
    put_timeout_s: Annotated[float, Meta(gt=0)]
    restart_servers: bool
    """The pipeline restarts dead servers: requests wait for them instead of failing."""
    health_interval_s: Annotated[float, Meta(gt=0)]
    return_routes: bool = False
    """Ask the servers for each token's routed experts (``trainer.moe.routing_replay`` `rollout`)."""

    @property
    def drain_timeout_s(self) -> float:
        """The longest a drain may take: every in-flight episode's turns, its reward and its put (the one
        formula: ``Rollouter.drain`` gives up after it, the controller waits for it plus its call margin)."""
        per_episode = self.rollout.request_timeout_s * self.agent.max_turns
        return per_episode + self.reward.timeout_s + self.put_timeout_s
