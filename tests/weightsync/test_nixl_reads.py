"""Which memory each side of a NIXL READ names: the local side is the receiver's, the remote the sender's."""

from __future__ import annotations

import torch

from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.nixl_engine import NixlTransport
from slipstream.weightsync.types import InitInfo, Rendezvous


class RecordingAgent:
    def __init__(self) -> None:
        self.descs: list[tuple[list, str]] = []

    def add_remote_agent(self, metadata: bytes) -> str:
        return "sender"

    def get_xfer_descs(self, descs: list, mem_type: str) -> tuple[list, str]:
        self.descs.append((descs, mem_type))
        return descs, mem_type

    def initialize_xfer(self, op: str, local, remote, peer: str) -> tuple:
        return op, local, remote, peer


def test_a_cpu_receiver_reads_a_gpu_senders_buffers_as_gpu_memory():
    receiver = NixlTransport(WeightSyncConfig(device="cpu"), is_sender=False, device="cpu")
    receiver.agent = RecordingAgent()
    sender = Rendezvous(backend="nixl", agent_name="s", agent_metadata=b"m", mem_type="VRAM",
                        buffers=[(0x7F0000, 1 << 20, 3)])  # fmt: skip
    receiver.connect(InitInfo(backend="nixl", rank=1, world_size=2, group_name="w", peers=[sender]))
    dest = torch.empty(64, dtype=torch.uint8)
    op, local, remote, peer = receiver._start_read("sender", dest, 0x7F0000, 3, 64)
    assert (op, peer) == ("READ", "sender")
    assert local == ([(dest.data_ptr(), 64, 0)], "DRAM")
    assert remote == ([(0x7F0000, 64, 3)], "VRAM")
