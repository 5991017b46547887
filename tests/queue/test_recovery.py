"""Trainer-only crash recovery: a snapshot restored on the live server rolls back to it (groups acked since come
back from the journal, nothing twice), a foreign snapshot merges, and across real processes a trainer killed
after its snapshot is replaced by one that trains every uid exactly once."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from slipstream.queue.client import QueueClient
from slipstream.queue.testing import make_group


def _ids(lease) -> list[str]:
    return [g.group_id for g in lease.groups]


def _same(got, sent) -> bool:
    return got.meta == sent.meta and all(torch.equal(got.tensors[n], t) for n, t in sent.tensors.items())


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_restore_on_the_live_server_rolls_back_to_the_snapshot(server):
    srv = server(shm_min_group_bytes=1024, journal=True)
    c = QueueClient(srv.address, timeout_s=30)
    remote = QueueClient(srv.address, timeout_s=30, shared_memory=False)  # its puts travel as frames
    # inline-only, socket-stored and arena groups
    sent = {
        f"g{i}": make_group(f"g{i}", payload=p) for i, p in enumerate([0, 100, 10_000, 10_000, 100, 10_000])
    }
    for gid, group in sent.items():
        assert (remote if gid == "g3" else c).put(group)
    c.ack(c.lease(2, timeout_s=5))  # g0, g1: trained before the checkpoint
    assert c.snapshot("ckpt")["groups"] == 4
    assert c.stats().journal_groups == 0
    c.ack(c.lease(3, timeout_s=5), dropped=["g3"])  # g2, g3 (too stale), g4: lost with the trainer
    assert c.stats().journal_groups == 3
    sent["g6"] = make_group("g6", payload=10_000)
    c.put(sent["g6"])  # arrived after the snapshot
    held = c.lease(1, timeout_s=5)  # g5: leased when the trainer "crashes"

    summary = c.restore("ckpt")
    assert summary["mode"] == "rollback"
    assert (summary["from_journal"], summary["from_snapshot"], summary["skipped_seen"]) == (3, 0, 4)
    assert c.pop_dropped() == []  # g3 is trainable again: not to be regenerated
    lease = c.lease(4, min_groups=1, timeout_s=5)
    assert _ids(lease) == ["g2", "g3", "g4", "g6"]  # in put order; g5 stays with its holder
    assert all(_same(g, sent[g.group_id]) for g in lease.groups)
    assert c.put(sent["g2"]) is False and c.put(sent["g0"]) is False  # held, and consumed in the snapshot
    c.ack(lease)
    c.ack(held)
    assert c.stats().journal_groups == 5
    remote.close()
    c.close()


def test_restoring_an_older_snapshot_brings_back_what_was_consumed_in_between(server):
    c = QueueClient(server(journal=True).address, timeout_s=30)
    sent = {f"g{i}": make_group(f"g{i}", payload=100) for i in range(4)}
    for group in sent.values():
        c.put(group)
    c.snapshot("a")
    c.ack(c.lease(2, timeout_s=5))  # g0, g1
    c.snapshot("b")  # commits: the journal lets g0 and g1 go
    c.ack(c.lease(1, timeout_s=5))  # g2, journalled
    summary = c.restore("a")
    assert (summary["mode"], summary["from_journal"], summary["from_snapshot"]) == ("rollback", 1, 2)
    lease = c.lease(4, timeout_s=5)
    assert _ids(lease) == ["g0", "g1", "g2", "g3"]
    assert all(_same(g, sent[g.group_id]) for g in lease.groups)
    c.ack(lease)
    c.close()


def test_a_fresh_server_merges_and_rolls_back_to_that_snapshot_later(server):
    first = QueueClient(server(journal=True).address, timeout_s=30)
    for i in range(3):
        first.put(make_group(f"g{i}", payload=100))
    first.ack(first.lease(1, timeout_s=5))
    first.snapshot("ckpt")
    first.close()

    c = QueueClient(server(journal=True).address, timeout_s=30)
    c.put(make_group("new"))
    assert c.restore("ckpt")["mode"] == "merge"
    c.ack(c.lease(1, timeout_s=5))  # g1, then the trainer crashes again
    summary = c.restore("ckpt")
    assert (summary["mode"], summary["from_journal"]) == ("rollback", 1)
    lease = c.lease(3, timeout_s=5)
    assert _ids(lease) == ["g1", "g2", "new"]
    assert c.put(make_group("g0")) is False
    c.ack(lease)
    c.close()


def test_without_a_journal_restore_merges(server):
    c = QueueClient(server(journal=False).address, timeout_s=30)
    c.put(make_group("a"))
    c.put(make_group("b"))
    c.snapshot("ckpt")
    c.ack(c.lease(1, timeout_s=5))
    assert c.restore("ckpt")["mode"] == "merge"
    assert _ids(c.lease(2, min_groups=1, timeout_s=5)) == ["b"]  # "a" is gone for good
    c.close()


def test_the_journal_holds_no_arena_space(server):
    srv = server(shm_min_group_bytes=0, journal=True)
    producer, consumer = QueueClient(srv.address, timeout_s=30), QueueClient(srv.address, timeout_s=30)
    producer.put(make_group("big", payload=50_000))
    producer.close()  # hands its credit for a next put back
    consumer.ack(consumer.lease(1, timeout_s=5))
    _wait(lambda: consumer.stats().journal_backlog_groups == 0, "the journal copy was never written")
    stats = consumer.stats()
    assert stats.journal_groups == 1 and stats.journal_bytes > 400_000
    assert stats.shm_bytes_used == 0
    consumer.close()


# A producer process: puts the groups named on stdin (`gid payload` per line), one result line per put.
PRODUCER = """
import sys, torch
torch.set_num_threads(1)
from slipstream.queue.client import QueueClient
from slipstream.queue.testing import make_group
with QueueClient(sys.argv[1]) as client:
    for line in sys.stdin:
        gid, payload = line.split()
        print(gid, client.put(make_group(gid, payload=int(payload))), flush=True)
"""

# A trainer process driven by stdin: `train N` leases N groups, prints their uids, acks; `snapshot PATH`;
# `hold N` leases N groups and prints their uids without acking.
TRAINER = """
import sys, torch
torch.set_num_threads(1)
from slipstream.queue.client import QueueClient
client = QueueClient(sys.argv[1])
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "snapshot":
        client.snapshot(arg)
        print("ok", flush=True)
        continue
    lease = client.lease(int(arg), timeout_s=30)
    print(" ".join(u for g in lease.groups for u in g.uids), flush=True)
    if cmd == "train":
        client.ack(lease)
"""


class _Driven:
    """A child process fed commands on stdin, answering one line each."""

    def __init__(self, script: str, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, f"child exited early with code {self.proc.wait()}"
        return out.strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_a_trainer_killed_after_its_snapshot_is_replaced_and_every_uid_is_trained_once(server_process):
    handle = server_process(lease_timeout_s=1.5, shm_min_group_bytes=2048, journal=True)
    payloads = [0, 100, 10_000]  # inline-only, socket-stored and arena groups
    sent = {f"g{i}": make_group(f"g{i}", payload=payloads[i % 3]) for i in range(16)}
    producer, trainer = _Driven(PRODUCER, handle.address), _Driven(TRAINER, handle.address)
    try:
        for i in range(12):
            assert producer.ask(f"g{i} {payloads[i % 3]}") == f"g{i} True"
        before = trainer.ask("train 4").split()  # trained, then checkpointed with the snapshot
        assert trainer.ask("snapshot ckpt") == "ok"
        lost = trainer.ask("train 3").split()  # trained by weights the crash throws away
        for i in range(12, 16):  # the producer goes on meanwhile
            assert producer.ask(f"g{i} {payloads[i % 3]}") == f"g{i} True"
        held = trainer.ask("hold 2").split()  # leased at the crash
    finally:
        trainer.stop()
        producer.proc.stdin.close()
        assert producer.proc.wait(30) == 0

    with QueueClient(handle.address, timeout_s=30) as resumed:
        assert resumed.restore("ckpt")["from_journal"] == 3
        after: list[str] = []
        while len(before) + len(after) < 32:  # the held lease comes back once it expires
            lease = resumed.lease(4, min_groups=1, timeout_s=30)
            assert lease is not None, f"only {len(before) + len(after)} of 32 samples were trained"
            assert all(_same(g, sent[g.group_id]) for g in lease.groups)
            after += [u for g in lease.groups for u in g.uids]
            resumed.ack(lease)
        assert resumed.lease(1, timeout_s=0.2) is None
    trained = before + after
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == {u for g in sent.values() for u in g.uids}, "a sample was lost"
    assert set(lost) <= set(after) and set(held) <= set(after)
