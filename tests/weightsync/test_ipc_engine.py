"""The ``ipc`` transport across real processes on the CPU (POSIX shared memory), and how ``auto`` chooses it.

The test process is the sender (except where the sender must die: then it is a child too); receivers are
child processes driven over pipes. Peers die abruptly (``os._exit``) in the middle of a version. Nothing
here waits on the clock: every wait is for a message or a process, and the timeouts are generous bounds
that a passing run never reaches (a peer's death is seen as the end of its connection).
"""

from __future__ import annotations

import asyncio
import gc
import os
import re

import msgspec
import pytest
import torch
from wsync_helpers import digest, engine_receiver, mixed_tensors, pipe, recv, send, spawn

from slipstream.weightsync.base import build_topology, make_transport
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.ipc_memory import colocated, host_identity
from slipstream.weightsync.types import InitInfo, Rendezvous

TIMEOUT_S = 120.0  # a bound, never reached: deaths are seen as the end of a connection
CFG = dict(bucket_mb=1, timeout_s=TIMEOUT_S)


def shm_mappings(pid: int | str = "self") -> int:
    """Shared-memory segments a process maps (torch's are unlinked at once: ``/dev/shm/... (deleted)``)."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[-2] for line in f if re.search(r"/dev/shm/\S+ \(deleted\)$", line.strip())})


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps")


class _Child:
    def __init__(self) -> None:
        self.conn, theirs = pipe()
        self.proc = spawn(engine_receiver, theirs, "ipc", CFG)
        self.rendezvous = msgspec.convert(recv(self.conn), Rendezvous)


class Cluster:
    def __init__(self, receivers: int) -> None:
        self.cfg = WeightSyncConfig(backend="ipc", device="cpu", **CFG)
        self.engine = make_transport("ipc", self.cfg, is_sender=True)
        self.children = [_Child() for _ in range(receivers)]
        self.connect(self.children)

    def connect(self, children: list[_Child]) -> None:
        mine, infos = build_topology(self.engine.prepare(), [c.rendezvous for c in children], "t")
        for child, info in zip(children, infos, strict=True):
            send(child.conn, {"op": "init", "info": msgspec.to_builtins(info)})
        self.engine.connect(mine)
        assert all(recv(c.conn)["ok"] for c in children)

    def push(self, version: int, tensors=None) -> list[dict]:
        for child in self.children:
            send(child.conn, {"op": "recv"})
        asyncio.run(self.engine.send_weights(tensors or mixed_tensors(version), version))
        return [recv(c.conn) for c in self.children]

    def close(self) -> None:
        for child in self.children:
            if child.proc.is_alive():
                send(child.conn, {"op": "stop"})
                recv(child.conn)
        self.engine.close()
        for child in self.children:
            child.proc.join(timeout=30)


def test_versions_arrive_bit_exact_with_mixed_dtypes_and_chunks_and_a_late_receiver_catches_up():
    cluster = Cluster(receivers=2)
    try:
        # 1 MiB buckets: the 2.8 MB tensor travels in chunks; fp8, bf16, fp16, a 0-d tensor, odd sizes.
        for version in (1, 2):
            replies = cluster.push(version)
            assert [(r["ok"], r["version"]) for r in replies] == [(True, version)] * 2, replies
            assert all(r["digest"] == digest(mixed_tensors(version)) for r in replies)
        cluster.children.append(_Child())
        cluster.connect(cluster.children)
        replies = cluster.push(2)
        assert [r["version"] for r in replies] == [2, 2, 2]
        assert replies[2]["digest"] == digest(mixed_tensors(2))
    finally:
        cluster.close()


def test_a_failing_tensor_iterator_makes_receivers_drop_the_version_and_the_group_stays_usable():
    cluster = Cluster(receivers=1)
    try:
        cluster.push(1)

        def broken():
            yield from mixed_tensors(2)[:3]
            raise RuntimeError("trainer failed while gathering")

        send(cluster.children[0].conn, {"op": "recv"})
        with pytest.raises(TransferError, match="receivers dropped it"):
            asyncio.run(cluster.engine.send_weights(broken(), 2))
        reply = recv(cluster.children[0].conn)
        assert reply["aborted"] and reply["version"] == 1 and reply["digest"] == digest(mixed_tensors(1))
        assert cluster.push(3)[0]["digest"] == digest(mixed_tensors(3))
    finally:
        cluster.close()


@needs_proc
def test_a_receiver_killed_mid_sync_fails_the_push_at_once_and_the_sender_frees_its_buffers():
    gc.collect()  # what earlier tests left for the collector is not counted as this test's
    before = shm_mappings()
    cluster = Cluster(receivers=2)
    try:
        assert shm_mappings() == before + 2  # the two shared bucket buffers
        cluster.push(1)
        for i, child in enumerate(cluster.children):
            send(child.conn, {"op": "recv", "die_after": 1 if i == 1 else None})
        with pytest.raises(TransferError, match="went away"):  # the end of its connection, not a timeout
            asyncio.run(cluster.engine.send_weights(mixed_tensors(2), 2))
        survivor = recv(cluster.children[0].conn)
        cluster.children[1].proc.join(timeout=30)
        assert cluster.children[1].proc.exitcode == 1
        assert (
            not survivor["ok"] and survivor["version"] == 1 and survivor["digest"] == digest(mixed_tensors(1))
        )
        pool = cluster.engine.pool
        held = [pool.acquire(0, timeout=0), pool.acquire(0, timeout=0)]  # both buffers were given back
        assert sorted(held) == [0, 1]
        for slot in held:
            pool.release(slot)
        del pool  # the pool's list holds the shared buffers: this frame must not keep them
        with pytest.raises(TransferError, match="rebuild"):
            asyncio.run(cluster.engine.send_weights(mixed_tensors(3), 3))
    finally:
        cluster.children = [c for c in cluster.children if c.proc.is_alive()]
        cluster.close()
    gc.collect()  # the failed sends' tracebacks hold frames that reference the buffers until collected
    assert shm_mappings() == before  # finalize let go of both buffers


def _dying_sender(conn, group: str) -> None:
    """Sends version 1 whole, then dies three tensors into version 2."""
    torch.set_num_threads(1)
    engine = make_transport("ipc", WeightSyncConfig(backend="ipc", device="cpu", **CFG), is_sender=True)
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


@needs_proc
def test_a_sender_killed_mid_sync_leaves_receivers_on_the_old_version_with_nothing_mapped():
    children = [_Child() for _ in range(2)]
    mine, theirs = pipe()
    sender = spawn(_dying_sender, theirs, "kill-send")
    try:
        send(mine, [msgspec.to_builtins(c.rendezvous) for c in children])
        for child, info in zip(children, recv(mine), strict=True):
            send(child.conn, {"op": "init", "info": msgspec.convert(info, InitInfo)})
        assert all(recv(c.conn)["ok"] for c in children)
        assert all(shm_mappings(c.proc.pid) == 2 for c in children)
        for version in (1, 2):
            for child in children:
                send(child.conn, {"op": "recv"})
            replies = [recv(c.conn) for c in children]
            if version == 1:
                assert all(r["ok"] and r["version"] == 1 for r in replies)
        assert all(not r["ok"] and r["version"] == 1 for r in replies), replies
        # Usually "... went away (its connection ended)"; a sender killed in the middle of a message can also
        # end the stream inside one (a decode error or a buffer without its descriptor): any failure will do,
        # what matters is the version, the digest and the mappings below.
        assert all(r["error"] for r in replies), replies
        assert all(r["digest"] == digest(mixed_tensors(1)) for r in replies)
        sender.join(timeout=30)
        assert sender.exitcode == 1
        # The segments are gone with the last mapping: the receivers dropped theirs when the sender died.
        assert all(shm_mappings(c.proc.pid) == 0 for c in children)
    finally:
        sender.kill()
        for child in children:
            send(child.conn, {"op": "stop"})
            recv(child.conn)
            child.proc.join(timeout=30)


# ------------------------------------------------------------------------------------ choosing the engine


def _rdv(host: str, device: str) -> Rendezvous:
    return Rendezvous(backend="ipc", host=host, device=device)


def test_colocated_needs_one_host_and_for_a_gpu_sender_the_same_physical_gpu():
    here = host_identity()
    assert colocated(_rdv(here, "cuda:GPU-a"), _rdv(here, "cuda:GPU-a"))
    assert not colocated(_rdv(here, "cuda:GPU-a"), _rdv(here, "cuda:GPU-b"))  # same host, another GPU
    assert not colocated(_rdv(here, "cuda:GPU-a"), _rdv("other/boot", "cuda:GPU-a"))  # same UUID string
    assert not colocated(_rdv(here, "cuda:GPU-a"), _rdv(here, "cpu"))
    assert colocated(_rdv(here, "cpu"), _rdv(here, "cpu"))
    assert colocated(_rdv(here, "cpu"), _rdv(here, "cuda:GPU-a"))  # host memory reaches any local device
    assert not colocated(_rdv(here, "cpu"), _rdv("other/boot", "cpu"))
    assert not colocated(_rdv("", "cpu"), _rdv("", "cpu"))
