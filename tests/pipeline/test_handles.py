"""The controller reaches actors through typed handles: no production code calls an actor by a method-name
string, every handle names real methods of its actor class, and a part used before it started says which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slipstream.pipeline.cluster import Pending
from slipstream.pipeline.handles import QueueHandle, RolloutHandle, ServerHandle, TrainerGroup
from slipstream.pipeline.parts import Parts
from tests.pipeline.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2] / "slipstream"


def _string_calls(path: Path) -> list[str]:
    """``x.call(actor, "name", ...)`` and ``getattr(actor, ...).remote(...)`` in one file, as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        receiver = ast.unparse(node.func.value)
        named = (
            node.func.attr == "call"
            and receiver.endswith("cluster")  # a Cluster's call; HTTP clients' call(method, path) are others
            and any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[1:2])
        )
        by_getattr = (
            node.func.attr == "remote"
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "getattr"
        )
        if named or by_getattr:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


def test_no_production_code_calls_an_actor_by_a_method_name_string():
    found = [hit for path in sorted(ROOT.rglob("*.py")) for hit in _string_calls(path)]
    # RayCluster.call is the one place a name is looked up: Ray's actor handles expose methods by name only.
    assert len(found) == 1 and found[0].startswith("slipstream/pipeline/cluster.py:"), found


def test_handles_call_the_actor_classes_methods_behind_a_fake_cluster():
    cluster = FakeCluster()
    server = ServerHandle(cluster, cluster.spawn("server0", object), "server-0")
    trainer = TrainerGroup(cluster, [cluster.spawn("rank0", object)])
    rollouter = RolloutHandle(cluster, cluster.spawn("rollouter", object))
    started = server.start()
    assert isinstance(started, Pending) and cluster.get(started, 1.0) == "http://server0:8001"
    assert trainer.endpoint() == ("127.0.0.1", 29500)
    rollouter.add_server("http://server0:8001")
    assert cluster.log == [
        ("server0", "start", ()),
        ("rank0", "endpoint", ()),
        ("rollouter", "add_server", ("http://server0:8001",)),
    ]


def test_each_handle_reports_its_process():
    cluster = FakeCluster()
    server = ServerHandle(cluster, cluster.spawn("server0", object), "server-0")
    trainer = TrainerGroup(cluster, [cluster.spawn("rank0", object), cluster.spawn("rank1", object)])
    assert server.pid() is None  # no server process yet
    cluster.get(server.start(), 1.0)
    assert server.pid() == 1001 and trainer.pids() == [2000, 2001]
    assert RolloutHandle(cluster, cluster.spawn("rollouter", object)).pid() == 3000
    assert QueueHandle(cluster, cluster.spawn("queue", object)).pid() == 4000


def test_a_part_used_before_it_started_names_itself():
    parts = Parts()
    assert not parts.trainer and not parts.rollouter and not parts.queue
    with pytest.raises(RuntimeError, match="the trainer ranks has not been started"):
        parts.trainer.publish(1, timeout_s=1.0)
