"""The launcher hands each actor its role's settings, never the whole config: trainer ranks get
``TrainerSettings`` with their own checkpoints off (the controller writes them), the rollouter
``RollouterSettings``, a server host the ``rollout`` section and the address it binds."""

from __future__ import annotations

from typing import Any

from slipstream.config import Config
from slipstream.pipeline.launcher import Launcher
from slipstream.pipeline.parts import Parts
from slipstream.queue.config import QueueConfig
from slipstream.rollouter.config import RolloutConfig
from slipstream.rollouter.settings import RollouterSettings
from slipstream.trainer.settings import TrainerSettings
from tests.pipeline.fake_cluster import FakeCluster, FakeRank, fake_config


class RecordingCluster(FakeCluster):
    """A fake cluster that keeps the constructor arguments of every actor it spawns, by part."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: dict[str, tuple[Any, ...]] = {}

    def spawn(self, part: str, cls: Any, *args: Any, **kwargs: Any):
        self.spawned[part] = args
        return super().spawn(part, cls, *args, **kwargs)


def test_each_actor_gets_its_roles_settings(tmp_path):
    cfg = fake_config(
        "trainer.num_ranks=2",
        "trainer.checkpoint_every=3",
        "trainer.batch_groups=5",
        "cluster.server_host=0.0.0.0",
    )
    launcher = Launcher(cfg, tmp_path, "token")
    launcher.cluster = cluster = RecordingCluster()
    FakeRank.version = 0
    parts = Parts(queue_address="tcp://queue:1")
    launcher.start_trainer(parts, None)
    launcher.create_rollouter(parts)
    launcher.new_host(0)

    for part in ("rank0", "rank1"):
        settings = cluster.spawned[part][0]
        assert isinstance(settings, TrainerSettings)
        assert settings.checkpoint_every == 0 and settings.trainer.checkpoint_every == 3
    rollouter = cluster.spawned["rollouter"][0]
    assert isinstance(rollouter, RollouterSettings) and rollouter.batch_groups == 5
    rollout, host = cluster.spawned["server0"][:2]
    assert isinstance(rollout, RolloutConfig) and host == "0.0.0.0"
    for args in cluster.spawned.values():
        assert not any(isinstance(a, (Config, dict)) for a in args), args


def test_the_queue_actor_gets_the_typed_queue_section(tmp_path, monkeypatch):
    import slipstream.queue.client as queue_client

    monkeypatch.setattr(queue_client, "QueueClient", lambda address, **kw: ("client of", address))
    cfg = fake_config("queue.capacity_groups=17")
    launcher = Launcher(cfg, tmp_path, "token")
    launcher.cluster = cluster = RecordingCluster()
    parts = Parts()
    launcher.start_queue(parts)
    (queue_cfg,) = cluster.spawned["queue"]
    assert isinstance(queue_cfg, QueueConfig) and queue_cfg.capacity_groups == 17
    assert parts.queue_address == "tcp://queue:5555" and parts.queue_client == (
        "client of",
        "tcp://queue:5555",
    )
