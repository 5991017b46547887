"""The ``ipc`` transport on GPU memory (CUDA IPC handles): two processes on one GPU, where NCCL refuses to run.

Every test needs CUDA (``gpu``); the last one needs two GPUs (``gpu2``) and checks that ``auto`` tells two
physical GPUs apart by UUID and so does not pick ``ipc`` between them.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from wsync_helpers import DictTarget, digest, mixed_tensors, pipe, recv, send, spawn

from slipstream.weightsync.base import build_topology, make_transport, receive_version
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.ipc_memory import colocated, device_identity
from slipstream.weightsync.types import InitInfo, Rendezvous

pytestmark = pytest.mark.gpu


def cuda_tensors(version: int):
    return [(n, t.cuda()) for n, t in mixed_tensors(version)]


def _gpu_receiver(conn) -> None:
    cfg = WeightSyncConfig(backend="ipc", bucket_mb=1, timeout_s=60, device="cuda")
    engine = make_transport("ipc", cfg, is_sender=False)
    send(conn, msgspec.to_builtins(engine.prepare()))
    engine.connect(msgspec.convert(recv(conn), InitInfo))
    target = DictTarget(cuda_tensors(0))
    for _ in range(2):
        asyncio.run(receive_version(engine, target.apply_weights))
        tensors = {k: v.cpu() for k, v in target.tensors.items()}
        send(conn, {"version": target.weight_version, "digest": digest(tensors), "mapped": engine.mapped})
    engine.close()


def test_versions_cross_between_two_processes_on_one_gpu_bit_exact():
    mine, theirs = pipe()
    child = spawn(_gpu_receiver, theirs)
    cfg = WeightSyncConfig(backend="ipc", bucket_mb=1, timeout_s=60, device="cuda")
    engine = make_transport("ipc", cfg, is_sender=True)
    try:
        receiver = msgspec.convert(recv(mine), Rendezvous)
        sender = engine.prepare()
        assert colocated(sender, receiver) and sender.device.startswith("cuda:")
        info, (theirs_info,) = build_topology(sender, [receiver], "gpu-ipc")
        send(mine, msgspec.to_builtins(theirs_info))
        engine.connect(info)
        for version in (5, 6):  # the second reuses both shared buffers
            asyncio.run(engine.send_weights(cuda_tensors(version), version))
            reply = recv(mine, timeout=120)
            assert reply == {"version": version, "digest": digest(mixed_tensors(version)), "mapped": 2}
    finally:
        engine.close()
        child.join(timeout=60)


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_of_one_host_are_told_apart_so_auto_does_not_pick_ipc_between_them():
    first, second = device_identity(torch.device("cuda", 0)), device_identity(torch.device("cuda", 1))
    assert first != second
    here = Rendezvous(backend="ipc", host="h", device=first)
    assert colocated(here, Rendezvous(backend="ipc", host="h", device=first))
    assert not colocated(here, Rendezvous(backend="ipc", host="h", device=second))
