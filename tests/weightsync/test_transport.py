"""The one transport abstraction: the shared topology, rendezvous as bytes, and a group link to servers whose
bucket metadata are announced over HTTP (what an SGLang or vLLM server receives), on the CPU."""

from __future__ import annotations

import asyncio
import typing

import msgspec
import pytest
from wsync_helpers import digest, mixed_tensors

from slipstream.weightsync.base import TRANSPORTS, Transport, TransportName, build_topology, make_transport
from slipstream.weightsync.buckets import BufferPool, Layout, StagingArea
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.nccl_uid import NcclUidTransport
from slipstream.weightsync.servers import ServerLink, stream_named
from slipstream.weightsync.types import InitInfo, Rendezvous


def test_every_transport_of_the_config_is_registered_with_both_ends_of_one_abc():
    for name in ("torch_dist", "ipc", "nixl", "nccl_uid"):
        assert issubclass(TRANSPORTS.get(name), Transport)
    with pytest.raises(ValueError, match="weightsync.backend"):
        TRANSPORTS.get("carrier_pigeon")


def test_each_transport_says_how_servers_join_it_under_its_one_name():
    """ServerLink asks the transport (``joins``), never its name; the registry's keys are TransportName's."""
    assert sorted(TRANSPORTS.names()) == sorted(typing.get_args(TransportName))
    joins = {name: TRANSPORTS.get(name).joins for name in TRANSPORTS.names()}
    assert joins == {"torch_dist": "group", "nccl_uid": "group", "nixl": "stream", "ipc": "stream"}
    assert [stream_named(b) for b in ("ipc", "nixl", "torch_dist", "naive", "auto")] == [
        "ipc",
        "nixl",
        None,
        None,
        None,
    ]
    torch_dist = make_transport("torch_dist", WeightSyncConfig(device="cpu"), is_sender=True)
    torch_dist.type_buckets(True)  # typed buckets are an NCCL matter: gloo sends bytes
    assert torch_dist.typed is False
    torch_dist.close()


def test_the_topology_gives_each_receiver_its_first_rank_and_the_sender_every_peer():
    sender = Rendezvous(backend="torch_dist", address="127.0.0.1", port=4321)
    servers = [Rendezvous(backend="torch_dist", ranks=2), Rendezvous(backend="torch_dist")]  # tp 2, tp 1
    mine, theirs = build_topology(sender, servers, "w")
    assert (mine.rank, mine.world_size, mine.peers) == (0, 4, servers)
    assert [(i.rank, i.world_size, i.group_name, i.peers) for i in theirs] == [
        (1, 4, "w", [sender]),
        (3, 4, "w", [sender]),
    ]
    assert all((i.address, i.port) == ("127.0.0.1", 4321) for i in [mine, *theirs])
    with pytest.raises(ValueError, match="cannot join a `torch_dist` sender"):
        build_topology(sender, [Rendezvous(backend="ipc")], "w")


def test_rendezvous_and_init_info_travel_as_msgpack_bytes_for_a_receiver_in_another_program():
    sender = Rendezvous(backend="nixl", agent_name="s", agent_metadata=b"\x00\xffblob", buffers=[(1, 2, 0)])
    receiver = make_transport("torch_dist", WeightSyncConfig(device="cpu"), is_sender=False)
    raw = msgspec.msgpack.encode(receiver.prepare())
    assert msgspec.msgpack.decode(raw, type=Rendezvous) == Rendezvous(backend="torch_dist")
    _, (info,) = build_topology(sender, [Rendezvous(backend="nixl")], "w")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=InitInfo)
    assert back == info and back.peers[0].agent_metadata == b"\x00\xffblob"
    receiver.close()


class _Server:
    """A server's control calls as a group link makes them: ranks, init, one update per bucket."""

    kind = "vllm"
    in_band = False  # vLLM's own engine: every bucket announced

    def __init__(self, url: str, ranks: int) -> None:
        self.url, self._ranks = url, ranks
        self.specs: list = []
        self.metas: list = []

    async def ranks(self) -> int:
        return self._ranks

    async def init_group(self, spec) -> None:
        self.specs.append(spec)

    async def update(self, meta) -> None:
        self.metas.append(meta)

    async def destroy_group(self, group_name: str) -> None:
        self.specs.append(("left", group_name))

    def layout(self) -> Layout:
        return Layout.vllm(1 << 20)


def test_a_group_link_gives_each_server_its_rank_and_the_unique_id_and_announces_every_bucket(monkeypatch):
    """The sender end of vLLM's own engine without a GPU: its NCCL calls are replaced by records; the link
    (rendezvous through each server's init call, then per-bucket announcements) is the production code."""
    joined, sent = [], []
    monkeypatch.setattr(
        NcclUidTransport, "prepare", lambda self: Rendezvous(backend="nccl_uid", nccl_unique_id=b"ABC")
    )
    monkeypatch.setattr(NcclUidTransport, "connect", lambda self, info: joined.append(info))
    monkeypatch.setattr(
        NcclUidTransport, "send_payload", lambda self, bucket: sent.append(bucket.data.clone())
    )
    servers = [_Server("http://a", ranks=2), _Server("http://b", ranks=1)]
    cfg = WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu")
    named = mixed_tensors(4)

    async def drive():
        link = await ServerLink.open("nccl_uid", servers, cfg, "cpu", "g", pool=BufferPool("cpu"))
        stats = await link.push(servers, iter(named), 4)
        await link.close(servers)
        return stats

    stats = asyncio.run(drive())
    assert [(i.rank, i.world_size) for i in joined] == [(0, 4)]
    specs = [s.specs[0] for s in servers]
    assert [(s.rank_offset, s.world_size, s.backend, s.nccl_unique_id_b64) for s in specs] == [
        (1, 4, "nccl", "QUJD"),
        (3, 4, "nccl", "QUJD"),
    ]
    assert servers[0].metas == servers[1].metas and len(sent) == stats.buckets == len(servers[0].metas)
    assert servers[0].metas[-1].last and stats.tensors == len(named)
    staging = StagingArea("cpu")  # what a receiver rebuilds from the announced metadata and the payloads
    staging.begin(4)
    for meta, payload in zip(servers[0].metas, sent, strict=True):
        staging.destination(meta).copy_(payload)
        staging.commit(meta)
    assert staging.complete
    assert digest(staging.staged) == digest(named)  # bit exact, every dtype and the chunked tensor
    assert servers[0].specs[-1] == ("left", "g")
