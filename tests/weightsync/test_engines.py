"""Transports across real processes: gloo groups and NIXL on DRAM, one sender, several receivers.

The test process is the sender (except where the sender must die: then it is a child too); receivers are
child processes driven over pipes (wsync_helpers.engine_receiver). Failures are injected by processes
exiting abruptly in the middle of a version. Where a death is what the test is about, every wait is bounded by
a short ``timeout_s`` (how a transport without a connection to watch learns of it); where nobody dies, the
bound is one no healthy transfer reaches, however loaded the machine (a late NIXL receiver's first bucket
took over 5 s on a busy 2-core machine).
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch
from wsync_helpers import digest, engine_receiver, mixed_tensors, pipe, recv, send, spawn, transport_of

from slipstream.weightsync.base import build_topology, make_transport
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import InitInfo, Rendezvous

TIMEOUT_S = 5.0  # tests where a process dies
HEALTHY_TIMEOUT_S = 120.0  # tests where none does: a bound, never reached
CFG = dict(bucket_mb=1, timeout_s=TIMEOUT_S)


class Cluster:
    """This process as the sender, plus receiver processes."""

    def __init__(self, backend: str, receivers: int, group: str, timeout_s: float = TIMEOUT_S) -> None:
        self.backend, self.group, self.timeout_s = backend, group, timeout_s
        self.cfg = WeightSyncConfig(backend=backend, device="cpu", **{**CFG, "timeout_s": timeout_s})
        self.engine = make_transport(transport_of(backend), self.cfg, is_sender=True)
        # ``naive`` is torch_dist with one tensor per bucket, each waited for
        self.layout = None if backend == "naive" else "default"
        self.children = [_Child(backend, timeout_s) for _ in range(receivers)]
        self.connect(self.children)

    def connect(self, children: list[_Child]) -> None:
        sender_info, infos = build_topology(
            self.engine.prepare(), [c.rendezvous for c in children], self.group
        )
        for child, info in zip(children, infos, strict=True):
            send(child.conn, {"op": "init", "info": msgspec.to_builtins(info)})
        self.engine.connect(sender_info)
        assert all(recv(c.conn)["ok"] for c in children)

    def push(self, version: int, tensors=None, die_after=None, children=None) -> list[dict]:
        children = children if children is not None else self.children
        for i, child in enumerate(children):
            send(child.conn, {"op": "recv", "die_after": die_after[i] if die_after else None})
        asyncio.run(self.engine.send_weights(tensors or mixed_tensors(version), version, layout=self.layout))
        return [recv(c.conn) for c in children]

    def close(self) -> None:
        stop_all(self.children, self.engine)


def stop_all(children: list[_Child], engine=None) -> None:
    """Everyone leaves at once (a healthy group's members meet at a barrier on the way out)."""
    alive = [c for c in children if c.proc.is_alive()]
    for child in alive:
        send(child.conn, {"op": "stop"})
    if engine is not None:
        engine.close()
    for child in alive:
        try:
            recv(child.conn, timeout=30)
        except (OSError, EOFError, TimeoutError):
            pass
    for child in children:
        child.proc.join(timeout=30)
        assert not child.proc.is_alive()


class _Child:
    def __init__(self, backend: str, timeout_s: float = TIMEOUT_S) -> None:
        self.conn, theirs = pipe()
        self.proc = spawn(engine_receiver, theirs, backend, {**CFG, "timeout_s": timeout_s})
        self.rendezvous = msgspec.convert(recv(self.conn), Rendezvous)


@pytest.mark.parametrize("backend", ["torch_dist", "nixl"])
def test_versions_arrive_bit_exact_at_every_receiver_and_a_late_receiver_catches_up(backend):
    cluster = Cluster(backend, receivers=2, group=f"exact-{backend}", timeout_s=HEALTHY_TIMEOUT_S)
    try:
        for version in (1, 2):
            replies = cluster.push(version)
            want = digest(mixed_tensors(version))
            assert [(r["ok"], r["version"]) for r in replies] == [(True, version)] * 2, replies
            assert all(r["digest"] == want for r in replies)
        # a receiver that joins late: the controller rebuilds the topology and re-sends the current version
        cluster.children.append(_Child(backend, HEALTHY_TIMEOUT_S))
        cluster.connect(cluster.children)
        replies = cluster.push(2)
        assert [r["version"] for r in replies] == [2, 2, 2]
        assert replies[2]["digest"] == digest(mixed_tensors(2))
    finally:
        cluster.close()


def test_naive_sends_tensor_by_tensor_to_the_same_receivers():
    cluster = Cluster("naive", receivers=1, group="naive", timeout_s=HEALTHY_TIMEOUT_S)
    try:
        stats_reply = cluster.push(1)
        assert stats_reply[0]["ok"] and stats_reply[0]["digest"] == digest(mixed_tensors(1))
    finally:
        cluster.close()


def test_a_sender_whose_tensor_iterator_fails_makes_receivers_drop_the_version():
    cluster = Cluster("torch_dist", receivers=1, group="abort")
    try:
        cluster.push(1)

        def broken():
            yield from mixed_tensors(2)[:3]
            raise RuntimeError("trainer failed while gathering")

        send(cluster.children[0].conn, {"op": "recv"})
        with pytest.raises(TransferError, match="receivers dropped it"):
            asyncio.run(cluster.engine.send_weights(broken(), 2))
        reply = recv(cluster.children[0].conn)
        assert reply["aborted"] and reply["version"] == 1
        assert reply["digest"] == digest(mixed_tensors(1))
        assert cluster.push(3)[0]["digest"] == digest(mixed_tensors(3))  # the group is still usable
    finally:
        cluster.close()


@pytest.mark.parametrize("backend", ["torch_dist", "nixl"])
def test_a_receiver_killed_mid_sync_fails_the_push_and_the_others_keep_their_version(backend):
    cluster = Cluster(backend, receivers=2, group=f"kill-recv-{backend}")
    try:
        cluster.push(1)
        for i, child in enumerate(cluster.children):
            send(child.conn, {"op": "recv", "die_after": 1 if i == 1 else None})
        with pytest.raises(TransferError):
            asyncio.run(cluster.engine.send_weights(mixed_tensors(2), 2))
        survivor = recv(cluster.children[0].conn, timeout=3 * TIMEOUT_S)  # nobody hangs past its timeouts
        cluster.children[1].proc.join(timeout=10)
        assert cluster.children[1].proc.exitcode == 1
        if not survivor["ok"]:  # the transfer was cut short for it too: it still serves version 1
            assert survivor["version"] == 1 and survivor["digest"] == digest(mixed_tensors(1))
        else:  # it had everything before the other one died: a whole version 2, never a mix
            assert survivor["version"] == 2 and survivor["digest"] == digest(mixed_tensors(2))
    finally:
        cluster.close()


def _dying_sender(conn, backend: str, group: str) -> None:
    """Sends version 1 whole, then dies after three tensors of version 2."""
    torch.set_num_threads(1)
    cfg = WeightSyncConfig(backend=backend, device="cpu", **CFG)
    engine = make_transport(backend, cfg, is_sender=True)
    rendezvous = [msgspec.convert(r, Rendezvous) for r in recv(conn)]
    info, infos = build_topology(engine.prepare(), rendezvous, group)
    send(conn, [msgspec.to_builtins(i) for i in infos])
    engine.connect(info)
    asyncio.run(engine.send_weights(mixed_tensors(1), 1))

    def dies():
        for i, item in enumerate(mixed_tensors(2)):
            if i == 3:
                os._exit(1)
            yield item

    asyncio.run(engine.send_weights(dies(), 2))


@pytest.mark.parametrize("backend", ["torch_dist", "nixl"])
def test_a_sender_killed_mid_sync_leaves_every_receiver_on_the_old_version(backend):
    children = [_Child(backend) for _ in range(2)]
    mine, theirs = pipe()
    sender = spawn(_dying_sender, theirs, backend, f"kill-send-{backend}")
    try:
        send(mine, [msgspec.to_builtins(c.rendezvous) for c in children])
        for child, info in zip(children, recv(mine), strict=True):
            send(child.conn, {"op": "init", "info": msgspec.convert(info, InitInfo)})
        assert all(recv(c.conn)["ok"] for c in children)
        for version in (1, 2):
            for child in children:
                send(child.conn, {"op": "recv"})
            replies = [recv(c.conn, timeout=3 * TIMEOUT_S) for c in children]
            if version == 1:
                assert all(r["ok"] and r["version"] == 1 for r in replies)
            else:
                assert all(not r["ok"] and r["version"] == 1 for r in replies), replies
                assert all(r["digest"] == digest(mixed_tensors(1)) for r in replies)
        sender.join(timeout=10)
        assert sender.exitcode == 1
    finally:
        sender.kill()
        stop_all(children)
