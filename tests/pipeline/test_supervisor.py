"""The supervisor's health checks and restart policy on a fake cluster: no Ray, no processes, no sockets,
no sleeps (time is a counter the test moves)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.pipeline.cluster import PartFailed
from slipstream.pipeline.handles import QueueHandle, RolloutHandle, ServerHandle, TrainerGroup
from slipstream.pipeline.launcher import Launcher
from slipstream.pipeline.parts import Parts, ServerPool
from slipstream.pipeline.supervisor import Supervisor
from slipstream.pipeline.types import PushReport, RankSetup, ServerHealth
from slipstream.utils import checkpoints
from slipstream.weightsync.publisher import PublishReport
from tests.pipeline.fake_cluster import FakeCluster, FakeRank, fake_config

DEAD = ServerHealth(alive=False, healthy=False, returncode=-9)
SICK = ServerHealth(alive=True, healthy=False)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(cluster: FakeCluster, kind: str, count: int) -> ServerPool:
    """``count`` servers serving at ``http://<kind><i>:8000``, host actors ``<kind><i>``."""
    out = ServerPool()
    for i in range(count):
        out.add(
            ServerHandle(cluster, cluster.spawn(f"{kind}{i}", object), f"{kind}-{i}"),
            f"http://{kind}{i}:8000",
        )
    return out


def running(tmp_path: Path, *overrides: str, servers: int = 1, published: int = 3, judges: int = 0):
    """A supervisor over a run with ``servers`` serving servers, ``judges`` judge servers of
    reward.service.launch, one rank, a rollouter and a queue."""
    cfg = fake_config(*overrides)
    cluster, clock = FakeCluster(), Clock()
    launcher = Launcher(cfg, tmp_path, "token")
    launcher.cluster = cluster
    parts = Parts(
        queue=QueueHandle(cluster, cluster.spawn("queue", object)),
        servers=pool(cluster, "server", servers),
        trainer=TrainerGroup(cluster, [cluster.spawn("rank0", object)]),
        rollouter=RolloutHandle(cluster, cluster.spawn("rollouter", object)),
        rollouter_started=True,
        version=published,
        published=published,
        judges=pool(cluster, "judge", judges),
    )
    FakeRank.version, FakeRank.kept_copy = published, True
    supervisor = Supervisor(cfg, cluster, parts, launcher, run_dir=tmp_path, clock=clock)
    return supervisor, cluster, clock


def set_health(cluster: FakeCluster, index: int, health: ServerHealth) -> None:
    cluster.actor(f"server{index}").obj.health_now = health


# ---------------------------------------------------------------------------------------- servers
def test_a_dead_server_is_restarted_caught_up_and_put_back(tmp_path):
    supervisor, cluster, clock = running(tmp_path, "cluster.restart_servers=true")
    cluster.hold("server0", "start")
    set_health(cluster, 0, DEAD)
    supervisor.poll()
    assert supervisor.restarts == {"server-0": 1} and supervisor.servers_restarting == {0}
    assert cluster.calls_of("rollouter", "remove_server") == [("http://server0:8000",)]
    assert cluster.calls_of("rank0", "remove_server") == [("http://server0:8000",)]
    supervisor.watch()  # still starting: nothing moves
    assert supervisor.servers_restarting == {0} and not cluster.calls_of("rank0", "add_server")

    set_health(cluster, 0, ServerHealth(alive=True, healthy=True))
    cluster.finish("server0", "start")
    supervisor.watch()
    new_url = "http://server0:8001"
    assert supervisor.parts.servers.urls == [new_url] and supervisor.servers_restarting == set()
    assert cluster.calls_of("rank0", "add_server") == [(new_url,)]  # the current weights first
    assert cluster.calls_of("rollouter", "add_server") == [(new_url,)]  # then requests


def test_a_dead_server_ends_the_run_when_restarts_are_off(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=false")
    set_health(cluster, 0, DEAD)
    with pytest.raises(PartFailed) as failed:
        supervisor.poll()
    message = str(failed.value)
    assert "inference server 0 (http://server0:8000) died: its process exited with code -9" in message
    assert "cluster.restart_servers is off" in message and "server0: last words" in message


def test_restarts_stop_at_max_restarts(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true", "cluster.max_restarts=1")
    set_health(cluster, 0, DEAD)
    supervisor.poll()  # restarted at once (start answers), dead again at the next check
    assert supervisor.restarts == {"server-0": 1}
    with pytest.raises(PartFailed, match="cluster.max_restarts used up"):
        supervisor.poll()


def test_failed_health_probes_count_in_a_row_before_a_restart(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true", "cluster.unhealthy_checks=2")
    set_health(cluster, 0, SICK)
    supervisor.poll()
    set_health(cluster, 0, ServerHealth(alive=True, healthy=True))
    supervisor.poll()  # a healthy answer starts the count again
    set_health(cluster, 0, SICK)
    supervisor.poll()
    assert supervisor.restarts == {}
    cluster.hold("server0", "start")
    supervisor.poll()
    assert supervisor.restarts == {"server-0": 1} and supervisor.servers_restarting == {0}


def test_a_dead_host_actor_is_replaced_before_the_restart(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true")
    old = cluster.actor("server0")
    cluster.die(old)
    supervisor.poll()
    host = supervisor.parts.servers[0].handle
    assert cluster.killed == ["server0"] and host is not None and host.actor is not old
    assert host.actor is cluster.actor("server0") and cluster.actor("server0").obj.starts == 1
    assert supervisor.restarts == {"server-0": 1}


def test_a_dead_judge_server_is_restarted_without_weights_and_handed_back_to_the_reward_service(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true", judges=2)
    cluster.hold("judge0", "start")
    cluster.actor("judge0").obj.health_now = DEAD
    supervisor.poll()
    assert supervisor.restarts == {"judge-0": 1} and supervisor.judges.restarting == {0}
    assert supervisor.servers_restarting == set()  # the rollout server serves on
    assert cluster.calls_of("rollouter", "set_judge_urls") == [(["http://judge1:8000"],)]
    cluster.actor("judge0").obj.health_now = ServerHealth(alive=True, healthy=True)
    cluster.finish("judge0", "start")
    supervisor.watch()
    urls = ["http://judge0:8001", "http://judge1:8000"]
    assert supervisor.parts.judges.urls == urls and supervisor.judges.restarting == set()
    assert cluster.calls_of("rollouter", "set_judge_urls")[-1] == (urls,)
    # A judge is no rollout server: the publisher and the balancer never hear of it.
    for part, method in (("rank0", "add_server"), ("rank0", "remove_server"), ("rollouter", "add_server")):
        assert not cluster.calls_of(part, method)


def test_a_lone_judge_keeps_its_url_while_its_dead_host_is_replaced_and_restarts_are_bounded(tmp_path):
    supervisor, cluster, _ = running(
        tmp_path, "cluster.restart_servers=true", "cluster.max_restarts=1", judges=1
    )
    old = cluster.actor("judge0")
    cluster.hold("judge0", "start")
    cluster.die(old)
    supervisor.poll()
    host = supervisor.parts.judges[0].handle
    assert cluster.killed == ["judge0"] and host is not None and host.actor is cluster.actor("judge0") != old
    # No judge left: the reward service keeps the URL and retries it (samples then score failure_score).
    assert cluster.calls_of("rollouter", "set_judge_urls") == [(["http://judge0:8000"],)]
    cluster.finish("judge0", "start")
    cluster.actor("judge0").obj.health_now = DEAD
    with pytest.raises(
        PartFailed, match=r"judge server 0 \(http://judge0:8001\) died: .*max_restarts used up"
    ):
        supervisor.poll()


def test_a_dead_judge_server_ends_the_run_when_restarts_are_off(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=false", judges=1)
    cluster.actor("judge0").obj.health_now = DEAD
    with pytest.raises(
        PartFailed, match=r"judge server 0 .*\(cluster.restart_servers is off\)(.|\n)*judge0: last words"
    ):
        supervisor.poll()


def test_health_is_checked_at_most_once_an_interval(tmp_path):
    supervisor, cluster, clock = running(tmp_path, "cluster.health_interval_s=5")
    supervisor.watch()
    supervisor.watch()
    clock.now += 4.9
    supervisor.watch()
    assert len(cluster.calls_of("server0", "health")) == 1
    clock.now += 0.2
    supervisor.watch()
    assert len(cluster.calls_of("server0", "health")) == 2


def test_a_server_restarted_before_the_trainer_kept_weights_joins_after_the_next_push(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true")
    FakeRank.kept_copy = False  # a restarted rank 0 holds no copy of the published weights yet
    set_health(cluster, 0, DEAD)
    supervisor.poll()
    supervisor.watch()  # the start finished: rank 0 is asked for the weights
    url = supervisor.parts.servers[0].url
    assert cluster.calls_of("rollouter", "add_server") == []  # no requests for stale weights
    supervisor.joined_after_push(PushReport(PublishReport(version=4, ok=[url])), 4)
    assert cluster.calls_of("rollouter", "add_server") == [(url,)]


def test_a_restart_that_cannot_take_the_weights_ends_the_run(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_servers=true")
    cluster.actor("rank0").obj.add_server = lambda url: PushReport(
        PublishReport(version=3, failed={url: "x"})
    )
    set_health(cluster, 0, DEAD)
    supervisor.poll()
    with pytest.raises(PartFailed, match="could not take version 3"):
        supervisor.watch()


def test_a_server_without_room_waits_while_others_serve_and_fails_the_run_when_none_is_left(tmp_path):
    args = ("cluster.restart_servers=true", "cluster.health_interval_s=1", "cluster.unhealthy_checks=2")
    supervisor, cluster, clock = running(tmp_path, *args, servers=2)
    cluster.hold("server1", "start")
    cluster.no_room.add("server1")  # its node is gone and the pool has no other room
    set_health(cluster, 1, DEAD)
    supervisor.poll()
    clock.now += 1.0
    supervisor.watch()
    assert supervisor.servers_without_room == set()  # not yet: room may come within 2 intervals
    clock.now += 1.5
    supervisor.watch()
    assert supervisor.servers_without_room == {1}  # the run goes on with server 0

    cluster.hold("server0", "start")
    cluster.no_room.add("server0")
    set_health(cluster, 0, DEAD)
    supervisor.poll()
    clock.now += 3.0
    with pytest.raises(PartFailed, match="no server is left"):
        supervisor.watch()


# ---------------------------------------------------------------------------------------- other parts
def test_a_failed_rollouter_or_a_stopped_queue_ends_the_run(tmp_path):
    supervisor, cluster, _ = running(tmp_path)
    cluster.actor("queue").obj.alive = False
    with pytest.raises(PartFailed, match="queue server's loop stopped"):
        supervisor.poll()
    cluster.actor("rollouter").obj.error = "ValueError: bad prompt"
    with pytest.raises(PartFailed, match="the rollouter failed: ValueError: bad prompt"):
        supervisor.poll()


def test_a_dead_rollouter_actor_ends_the_run_naming_it(tmp_path):
    supervisor, cluster, _ = running(tmp_path)
    cluster.die(cluster.actor("rollouter"))
    cluster.lost = {"node-a": ["rollouter", "server0"]}
    with pytest.raises(PartFailed, match=r"rollouter died: .*node node-a \(holding rollouter, server0\)"):
        supervisor.poll()


# ---------------------------------------------------------------------------------------- trainer
def write_checkpoint(run_dir: Path, version: int) -> Path:
    path = checkpoints.step_dir(checkpoints.checkpoint_root(run_dir), version)
    path.mkdir(parents=True)
    checkpoints.mark_complete(path, version)
    return path


@pytest.mark.parametrize(
    ("overrides", "checkpoint", "lost", "why"),
    [
        (["cluster.restart_trainer=false"], True, {}, "cluster.restart_trainer is off"),
        (["cluster.restart_trainer=true"], False, {}, "no checkpoint to restart from"),
        (
            ["cluster.restart_trainer=true"],
            True,
            {"n1": ["queue", "rank0"]},
            "the queue server's node is gone",
        ),
    ],
)
def test_a_dead_trainer_is_not_restarted_and_the_reason_is_named(tmp_path, overrides, checkpoint, lost, why):
    supervisor, cluster, _ = running(tmp_path, *overrides)
    if checkpoint:
        write_checkpoint(tmp_path, 2)
    cluster.lost = lost
    with pytest.raises(
        PartFailed, match=f"trainer failed at version 3 \\(a rank died\\); not restarted: {why}"
    ):
        supervisor.restart_trainer("a rank died")
    assert cluster.killed == []


def test_a_dead_trainer_restarts_every_rank_from_the_latest_checkpoint(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_trainer=true", "trainer.num_ranks=2")
    write_checkpoint(tmp_path, 2)
    latest = write_checkpoint(tmp_path, 4)
    FakeRank.version = 4
    assert supervisor.restart_trainer("a rank died") == 4
    assert cluster.killed == ["rank0"] and supervisor.restarts == {"trainer": 1}
    assert [r.part for r in supervisor.parts.trainer.ranks] == ["rank0", "rank1"]
    setups = cluster.calls_of("rank0", "setup") + cluster.calls_of("rank1", "setup")
    assert setups == [(RankSetup("127.0.0.1", 29500, "", str(latest)),)] * 2
    assert cluster.calls_of("rank1", "attach_servers") == [(["http://server0:8000"], "token")]


def test_trainer_restarts_stop_at_max_restarts(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_trainer=true", "cluster.max_restarts=1")
    write_checkpoint(tmp_path, 2)
    supervisor.restart_trainer("a rank died")
    with pytest.raises(PartFailed, match="cluster.max_restarts=1 used up"):
        supervisor.restart_trainer("a rank died again")


def test_a_save_that_died_after_its_queue_snapshot_is_completed_and_resumed_from(tmp_path):
    supervisor, cluster, _ = running(tmp_path, "cluster.restart_trainer=true")
    write_checkpoint(tmp_path, 2)
    staging = checkpoints.staging_dir(checkpoints.checkpoint_root(tmp_path), 4)
    (staging / "queue").write_bytes(b"snapshot")
    (staging / "rollouter.json").write_text("{}")
    supervisor.restart_trainer("a rank died")
    resumed = cluster.calls_of("rank0", "setup")[-1][0].resume_path
    assert resumed == str(checkpoints.step_dir(checkpoints.checkpoint_root(tmp_path), 4))
    assert checkpoints.read_version(resumed) == 4


def test_servers_the_launcher_starts_after_the_supervisor_is_built_are_watched(tmp_path):
    # The controller builds the supervisor before start-up; the launcher then fills the pools of Parts.
    cfg = fake_config("cluster.restart_servers=true")
    cluster = FakeCluster()
    launcher = Launcher(cfg, tmp_path, "token")
    launcher.cluster = cluster
    parts = Parts(
        queue=QueueHandle(cluster, cluster.spawn("queue", object)),
        trainer=TrainerGroup(cluster, [cluster.spawn("rank0", object)]),
        rollouter=RolloutHandle(cluster, cluster.spawn("rollouter", object)),
    )
    supervisor = Supervisor(cfg, cluster, parts, launcher, run_dir=tmp_path, clock=Clock())
    parts.servers.add(launcher.new_host(0), "http://server0:8000")
    parts.judges.add(launcher.new_judge_host(0), "http://judge0:8000")
    set_health(cluster, 0, DEAD)
    cluster.actor("judge0").obj.health_now = DEAD
    supervisor.poll()
    assert supervisor.restarts == {"server-0": 1, "judge-0": 1}
    supervisor.watch()  # the restarts finished: both serve at their new URLs
    assert parts.servers.urls == ["http://server0:8001"] and parts.judges.urls == ["http://judge0:8001"]
