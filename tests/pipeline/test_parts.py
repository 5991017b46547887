"""The server pools of ``Parts``: every write to a server's handle, URL and state goes through its pool, and a
slot cannot be changed behind the pool's back."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.pipeline.handles import ServerHandle
from slipstream.pipeline.parts import Parts, ServerPool
from tests.pipeline.fake_cluster import FakeCluster


def test_a_pool_walks_a_server_through_a_restart_on_a_new_host():
    cluster = FakeCluster()
    pool = ServerPool()
    first = ServerHandle(cluster, cluster.spawn("server0", object), "server-0")
    assert (
        pool.add(first) == 0 and pool.add(ServerHandle(cluster, cluster.spawn("server1", object), "s1")) == 1
    )
    pool.serving(0, "http://a:1")
    pool.serving(1, "http://b:1")
    pool.mark_down(0)
    assert (
        pool.down == {0} and pool.live_urls() == ["http://b:1"] and pool.urls == ["http://a:1", "http://b:1"]
    )
    assert pool.hosts(down=True) == [first] and len(pool.hosts(down=False)) == 1
    second = ServerHandle(cluster, cluster.spawn("server0", object), "server-0")
    pool.replace_host(0, second)
    assert pool[0].handle is second and pool[0].down  # still down until it answers
    pool.serving(0, "http://a:2")
    assert pool.down == set() and pool.live_urls() == ["http://a:2", "http://b:1"]


def test_servers_given_by_url_have_no_host_and_slots_are_frozen():
    pool = Parts().servers
    pool.add(None, "http://given:1")
    assert pool.urls == ["http://given:1"] and pool.hosts() == [] and len(pool) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool[0].url = "http://elsewhere:1"  # type: ignore[misc]
