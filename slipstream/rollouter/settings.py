"""What the rollouter is built from: its own config sections plus the few values it takes from other roles.

The rollouter owns the sections of what it runs (``rollout``: servers and sampling, ``data``, ``agent``,
``reward``, ``eval``) and the shared ``model``; from other roles it needs the admission budget (the
``async`` knobs and ``trainer.batch_groups``), the queue's put timeout and how the pipeline watches servers.
:func:`from_root` is the one place that maps root keys to the rollouter, so which keys reach it is visible
here and tested (tests/rollouter/test_rollouter_settings.py), and the pipeline hands the rollouter's actor this
struct (msgspec Structs travel through Ray), never the whole config.

Worked example::

    settings = from_root(load_config("configs/quickstart.yaml"))
    settings.batch_groups                # trainer.batch_groups
    rollouter = Rollouter(settings, balancer, queue, tokenizer, PromptSource.from_config(settings.data))
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.agents.config import AgentConfig, DataConfig, RewardConfig
from slipstream.config import Config, ModelConfig
from slipstream.config_base import settings_from_root
from slipstream.rollouter.config import EvalConfig, RolloutConfig

# Root key of every field that is not a whole section; from_root reads exactly these.
ROOT_KEYS = {
    "seed": "run.seed",
    "mode": "async.mode",
    "staleness_threshold": "async.staleness_threshold",
    "sync_every": "async.sync_every",
    "stale_policy": "async.stale_policy",
    "max_stale_drops": "async.max_stale_drops",
    "batch_groups": "trainer.batch_groups",
    "put_timeout_s": "queue.put_timeout_s",
    "restart_servers": "cluster.restart_servers",
    "health_interval_s": "cluster.health_interval_s",
}


class RollouterSettings(msgspec.Struct, kw_only=True):
    """The rollouter's config: its sections, and named values from other roles (root key in ``ROOT_KEYS``).

    Error messages name the root key (``rollout.n``, ``trainer.batch_groups``), which is what users write.
    """

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

    @property
    def drain_timeout_s(self) -> float:
        """The longest a drain may take: every in-flight episode's turns, its reward and its put (the one
        formula: ``Rollouter.drain`` gives up after it, the controller waits for it plus its call margin)."""
        per_episode = self.rollout.request_timeout_s * self.agent.max_turns
        return per_episode + self.reward.timeout_s + self.put_timeout_s


def from_root(cfg: Config) -> RollouterSettings:
    """The rollouter's settings from the root config: its sections whole, every other value from its ROOT_KEYS key
    (the ``async`` values with their mode's preset applied: ``AsyncConfig.with_preset``)."""
    cfg = msgspec.structs.replace(cfg, async_=cfg.async_.with_preset()[0])
    return settings_from_root(RollouterSettings, cfg, ROOT_KEYS)
