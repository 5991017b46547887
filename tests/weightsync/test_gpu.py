"""Weight sync on a GPU: NCCL groups, NIXL on GPU memory, and live vLLM / SGLang servers when installed.

Every test here needs CUDA (``gpu`` marker); the live-server tests also need the pinned server package and a
local model directory in ``SLIPSTREAM_TEST_MODEL`` (nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
import os

import msgspec
import pytest
import torch
from wsync_helpers import digest, mixed_tensors, pipe, recv, send, spawn

from slipstream.serverkinds import server_kind
from slipstream.weightsync.base import build_topology, make_transport, receive_version
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.types import InitInfo, Rendezvous

pytestmark = pytest.mark.gpu


def cuda_tensors(version: int):
    return [(n, t.cuda()) for n, t in mixed_tensors(version)]


def _gpu_receiver(conn, backend: str) -> None:
    import asyncio

    from wsync_helpers import DictTarget

    cfg = WeightSyncConfig(backend=backend, bucket_mb=1, timeout_s=60, device="cuda")
    engine = make_transport(backend, cfg, is_sender=False)
    send(conn, msgspec.to_builtins(engine.prepare()))
    engine.connect(msgspec.convert(recv(conn), InitInfo))
    target = DictTarget(cuda_tensors(0))
    asyncio.run(receive_version(engine, target.apply_weights))
    send(
        conn,
        {"version": target.weight_version, "digest": digest({k: v.cpu() for k, v in target.tensors.items()})},
    )
    engine.close()


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# NCCL never puts two ranks on one GPU ("Duplicate GPU detected"): torch_dist needs a GPU per process. NIXL
# runs on one GPU, when it is installed (the GPU check's stage 1 carries no NIXL).
BACKENDS = [
    pytest.param(
        "torch_dist", marks=[pytest.mark.gpu2, pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")]
    ),
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu13") is None,
            reason="needs nixl",
        ),
    ),  # fmt: skip
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_version_crosses_between_two_processes_on_the_gpu_bit_exact(backend):
    import asyncio

    mine, theirs = pipe()
    child = spawn(_gpu_receiver, theirs, backend)
    cfg = WeightSyncConfig(backend=backend, bucket_mb=1, timeout_s=60, device="cuda")
    engine = make_transport(backend, cfg, is_sender=True)
    rendezvous = msgspec.convert(recv(mine), Rendezvous)
    info, (theirs_info,) = build_topology(engine.prepare(), [rendezvous], "gpu")
    send(mine, msgspec.to_builtins(theirs_info))
    engine.connect(info)
    asyncio.run(engine.send_weights(cuda_tensors(5), 5))
    reply = recv(mine, timeout=120)
    engine.close()
    child.join(timeout=60)
    assert reply == {"version": 5, "digest": digest(mixed_tensors(5))}


def _live(kind: str):
    """A live-server case, skipped (at collection, not in a fixture) without its package or a model."""
    reason = (
        f"needs {kind}" if importlib.util.find_spec(kind) is None
        else "needs SLIPSTREAM_TEST_MODEL" if not os.environ.get("SLIPSTREAM_TEST_MODEL") else None
    )  # fmt: skip
    return pytest.param(kind, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


@pytest.mark.parametrize("kind", [_live("vllm"), _live("sglang")])
def test_a_live_server_takes_a_version_and_reports_it(kind):
    from transformers import AutoModelForCausalLM

    from slipstream.rollouter.launch import launch_server
    from slipstream.weightsync.publisher import WeightPublisher

    path = os.environ["SLIPSTREAM_TEST_MODEL"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    with launch_server(server_kind(kind), path) as server:
        server.wait_healthy(900)
        pub = WeightPublisher(
            WeightSyncConfig(bucket_mb=64, timeout_s=300, device="cuda"), [server.url], server_kind(kind)
        )
        try:
            report = pub.publish(1, ((n, p.detach()) for n, p in model.named_parameters()))
            assert report.ok == [server.url], report
        finally:
            pub.close()
