"""A group that cannot be used is refused at put time, and one that its consumer still cannot unpack is
quarantined: taken out of its lease and never delivered again, so it holds no valid group hostage."""

from __future__ import annotations

import pytest
import zmq

from slipstream.queue import ops
from slipstream.queue import protocol as P
from slipstream.queue.client import QueueClient
from slipstream.queue.codec import DTYPE_NAMES, Codec
from slipstream.queue.testing import make_group
from slipstream.queue.types import COLUMN_DTYPES, GroupMeta, SampleMeta


@pytest.fixture
def poison_fails_to_unpack(monkeypatch):
    """Consumers fail to unpack any group with a tensor named ``poison`` (as a stride overflow would)."""
    unpack = ops.unpack

    def failing(specs, buffers):
        if any(spec.name == "poison" for spec in specs):
            raise RuntimeError("stride overflow")
        return unpack(specs, buffers)

    monkeypatch.setattr(ops, "unpack", failing)


def _raw_put(srv, header: P.PutRequest, frames: list[bytes]) -> object:
    """Send a hand-made PUT to storage unit 0 and return the decoded reply."""
    codec, ctx = Codec(), zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{srv.units[0].port}")
        sock.send_multipart([*codec.encode(P.MsgType.PUT, header), *frames])
        assert sock.poll(10_000), "no reply"
        return codec.decode_reply(sock.recv_multipart(), P.MsgType.PUT)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_an_empty_group_with_an_overflowing_shape_is_refused_at_put(server):
    srv = server()
    meta = GroupMeta("z", [SampleMeta("z-0", 0, 0, 0, 0)])
    columns = [P.TensorSpec(name, DTYPE_NAMES[dtype], [0]) for name, dtype in COLUMN_DTYPES.items()]
    poison = P.TensorSpec("extra", "float32", [0, 2**62, 2**62])
    reply = _raw_put(srv, P.PutRequest(1, "train", meta, [*columns, poison], 1.0), [])
    assert isinstance(reply, P.ErrorReply) and "spans" in reply.message
    with QueueClient(srv.address, timeout_s=30) as c:
        assert c.stats().held_groups == 0


def test_a_frame_larger_than_its_tensor_is_refused(server):
    srv = server()
    group = make_group("padded", payload=100)
    from slipstream.queue.codec import pack_frames

    specs, buffers = pack_frames(group.tensors, 0)
    frames = [bytes(memoryview(b).cast("B")) for b in buffers]
    frames[-1] += b"\0" * 100_000  # 100 kB held, a few hundred bytes accounted
    reply = _raw_put(srv, P.PutRequest(1, "train", group.meta, specs, 1.0), frames)
    assert isinstance(reply, P.ErrorReply) and "must hold exactly" in reply.message


@pytest.mark.parametrize("shared_memory", [True, False])
@pytest.mark.usefixtures("poison_fails_to_unpack")
def test_a_group_that_cannot_be_unpacked_is_quarantined_not_redelivered(server, shared_memory):
    srv = server(lease_timeout_s=600, shm_min_group_bytes=0)
    c = QueueClient(srv.address, timeout_s=30, shared_memory=shared_memory)
    poisoned = make_group("bad", payload=300)
    poisoned.tensors["poison"] = poisoned.tensors.pop("payload")
    assert c.put(poisoned) and c.put(make_group("good", payload=300))
    lease = c.lease(2, timeout_s=5)
    assert [g.group_id for g in lease.groups] == ["good"]  # not held hostage
    c.ack(lease)
    stats = c.stats()
    assert stats.partitions["train"].quarantined_total == 1 and stats.held_groups == 0
    assert c.lease(1, timeout_s=0.2) is None  # never delivered again
    assert c.put(poisoned) is False  # and not taken again
    assert c.put(make_group("later")) and [g.group_id for g in c.lease(1, timeout_s=5).groups] == ["later"]
    c.close()


@pytest.mark.usefixtures("poison_fails_to_unpack")
def test_a_lease_of_only_unusable_groups_waits_for_usable_ones(server):
    srv = server(lease_timeout_s=600)
    c = QueueClient(srv.address, timeout_s=30)
    poisoned = make_group("bad")
    poisoned.tensors["poison"] = poisoned.tensors["logprobs"].clone()
    assert c.put(poisoned)
    assert c.lease(1, timeout_s=0.5) is None
    assert c.stats().partitions["train"].quarantined_total == 1
    c.close()
