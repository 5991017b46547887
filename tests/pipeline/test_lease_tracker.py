"""Rank 0's lease tracker (pipeline/actors.py): the trainer's queue consumer over a real in-process server,
recording the leases it holds so that a successor after a crash gives them back at once."""

from __future__ import annotations

import json

import pytest

from slipstream.pipeline.actors import _TrackedQueue
from slipstream.queue.base import QueueConsumer
from slipstream.queue.client import QueueClient
from slipstream.queue.config import QueueConfig
from slipstream.queue.server import QueueServer
from slipstream.queue.testing import make_group


@pytest.fixture
def srv(tmp_path):
    server = QueueServer(
        QueueConfig(lease_timeout_s=600, shm_bytes_per_unit=8 << 20, snapshot_dir=str(tmp_path))
    )
    yield server.start()
    server.stop()


def test_the_lease_tracker_is_a_consumer_that_records_what_it_holds(srv, tmp_path):
    owner = b"k" * 16  # every rank 0 of a run has the same secret, so a successor can nack
    tracked = _TrackedQueue(QueueClient(srv.address, timeout_s=30, owner=owner), tmp_path / "leases.json")
    assert isinstance(tracked, QueueConsumer)
    for gid in "abc":
        assert tracked.client.put(make_group(gid))
    first = tracked.lease(1, timeout_s=5, consumer_version=0)
    assert [g.group_id for g in first.groups] == ["a"]
    assert json.loads(tracked.lease_file.read_text()) == [first.lease_id]
    assert tracked.lease(3, timeout_s=0.2, min_groups=3) is None  # only 2 ready: parks until the timeout
    assert tracked.wait_s > 0
    assert tracked.snapshot("snap")["groups"] == 3
    tracked.ack(first)
    held = tracked.lease(1, timeout_s=5)
    assert json.loads(tracked.lease_file.read_text()) == [held.lease_id]

    # rank 0 died holding `held`: its successor gives it back at once instead of waiting for its expiry
    successor = _TrackedQueue(QueueClient(srv.address, timeout_s=30, owner=owner), tracked.lease_file)
    assert successor.release_stale_leases() == 1 and not successor.lease_file.exists()
    again = successor.lease(2, timeout_s=5)
    assert [g.group_id for g in again.groups] == ["b", "c"]
    successor.nack(again)
    assert json.loads(successor.lease_file.read_text()) == []
    assert successor.restore("snap")["mode"] == "merge"
    for client in (tracked.client, successor.client):
        client.close()
