"""Shared pieces of the weight-sync tests: model-like tensor sets, digests, a dict-backed WeightTarget, the
receiver process the engine tests drive over a pipe (msgpack messages, as everywhere else) and the serving
processes on loopback the publisher tests push to (:class:`TargetServers`)."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import time

import httpx
import msgspec
import torch

BIG_NUMEL = 700_000  # 2.8 MB of float32: larger than the 1 MiB buckets the tests use


def mixed_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """A model-like set with every dtype a checkpoint holds, fp8 included, and a tensor larger than a
    bucket; values depend on ``version`` so two versions never compare equal."""
    g = torch.Generator().manual_seed(version)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return [
        ("embed.weight", randn(BIG_NUMEL)),  # chunked across buckets
        ("layers.0.attn.q.weight", randn(64, 48).to(torch.bfloat16)),
        ("layers.0.attn.k.weight", randn(16, 48).to(torch.float16)),
        ("layers.0.mlp.up.weight", randn(96, 48).to(torch.float8_e4m3fn)),
        ("layers.0.mlp.down.weight", randn(48, 96).to(torch.float8_e5m2)),
        ("layers.0.norm.weight", randn(48)),
        ("layers.0.mlp.scale", randn(())),  # a 0-d tensor
        ("layers.1.mlp.gate.weight", randn(300_000)),  # 1.2 MB: sent straight from its own memory
        ("layers.1.norm.weight", randn(48).to(torch.bfloat16)),
        ("lm_head.weight", randn(33, 17)),  # odd byte count: the next entry starts unaligned in SGLang form
    ]


def digest(named: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> dict[str, str]:
    items = named.items() if isinstance(named, dict) else named
    return {
        name: hashlib.sha256(
            t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        + f":{str(t.dtype)}:{list(t.shape)}"
        for name, t in items
    }


class DictTarget:
    """A WeightTarget over a dict of tensors: copies on apply, like a server's model would."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], version: int = 0) -> None:
        self.tensors = {name: t.clone() for name, t in named}
        self.weight_version = version
        self.applied: list[int] = []

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def apply_weights(self, named_tensors, version: int) -> None:
        staged = list(named_tensors)
        for name, tensor in staged:
            if name not in self.tensors or tuple(tensor.shape) != tuple(self.tensors[name].shape):
                raise ValueError(f"unknown or misshaped parameter {name!r}")
        for name, tensor in staged:
            self.tensors[name].copy_(tensor)
        self.weight_version = version
        self.applied.append(version)


def context():
    """Children fork from a server that imported torch and these modules once (seconds saved per child)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["wsync_helpers", "slipstream.weightsync.torch_dist"])
    return ctx


def spawn(target, *args) -> mp.Process:
    proc = context().Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def pipe():
    return context().Pipe()


def send(conn, obj) -> None:
    conn.send_bytes(msgspec.msgpack.encode(obj))


def recv(conn, timeout: float = 60.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child process within {timeout} s")
    return msgspec.msgpack.decode(conn.recv_bytes())


def transport_of(backend: str) -> str:
    """The transport a ``weightsync.backend`` names (``naive`` is torch_dist cut one tensor per bucket)."""
    return "torch_dist" if backend == "naive" else backend


def engine_receiver(conn, backend: str, cfg_kwargs: dict) -> None:
    """A receiving transport end in its own process (not a server), driven by messages:

    ``{"op": "init", "info": InitInfo}`` joins; ``{"op": "recv", "die_after": n}`` receives one version
    into a DictTarget (exiting abruptly after ``n`` tensors when given) and answers with the outcome and the
    digest of what now serves; ``{"op": "stop"}`` leaves.
    """
    torch.set_num_threads(1)
    from slipstream.weightsync.base import make_transport
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.errors import TransferAborted, TransferError
    from slipstream.weightsync.types import InitInfo

    cfg = WeightSyncConfig(backend=backend, device="cpu", **cfg_kwargs)
    engine = make_transport(transport_of(backend), cfg, is_sender=False)
    target = DictTarget(mixed_tensors(0))
    send(conn, msgspec.to_builtins(engine.prepare()))
    while True:
        msg = recv(conn, timeout=600)
        if msg["op"] == "stop":
            engine.close()
            send(conn, {"ok": True})
            return
        if msg["op"] == "init":
            engine.connect(msgspec.convert(msg["info"], InitInfo))
            send(conn, {"ok": True})
        elif msg["op"] == "recv":
            reply = {"ok": True, "error": "", "aborted": False}
            try:
                asyncio.run(_receive(engine, target, msg.get("die_after")))
            except TransferAborted as err:
                reply.update(ok=False, aborted=True, error=str(err))
            except TransferError as err:
                reply.update(ok=False, error=str(err))
            reply.update(version=target.weight_version, digest=digest(target.tensors))
            send(conn, reply)


async def _receive(engine, target: DictTarget, die_after: int | None) -> None:
    stream = engine.receive_weights()
    staged = {}
    async for name, tensor in stream:
        staged[name] = tensor
        if die_after is not None and len(staged) >= die_after:
            os._exit(1)  # a receiver dying in the middle of a transfer
    target.apply_weights(staged.items(), stream.version)


class TargetServers:
    """Serving processes on loopback, each running ``serve(port, fault)`` of a target-server module
    (``wsync_target_server``, ``ipc_target_server``; ``fault`` is that module's injected death, or None):
    started, restarted on the same port (a server that lost everything it kept) and stopped."""

    def __init__(self, serve) -> None:
        self.serve = serve
        self.procs: dict[int, mp.Process] = {}

    def start(self, fault: int | None = None, *, port: int | None = None) -> str:
        from slipstream.utils.net import free_port

        port = port or free_port()
        proc = self.procs[port] = spawn(self.serve, port, fault)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # a bound, never reached: a server that exits fails at once
        while time.monotonic() < deadline:
            assert proc.is_alive(), f"server {url} exited while starting"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError(f"server {url} did not start")

    def restart(self, url: str) -> None:
        """Kill the server and start a fresh one on the same port (free again once the old one is gone)."""
        port = int(url.rsplit(":", 1)[1])
        proc = self.procs.pop(port)
        proc.kill()
        proc.join(timeout=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.start(port=port)
                return
            except (AssertionError, TimeoutError, OSError):  # the port not yet free: the new one exited
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.join(timeout=10)


def served(url: str) -> dict:
    """What a target server serves: the digest of its tensors and its version."""
    return httpx.get(f"{url}/digest", timeout=30).json()


def status(url: str) -> dict:
    return httpx.get(f"{url}/weightsync/status", timeout=30).json()


def corrupt_once(monkeypatch, version: int):
    """One byte of ``version``'s first packed tensor flipped after the sender digested it (bench_boundary's
    CorruptOnce); ``.name`` is the tensor hit."""
    from slipstream.system.bench_boundary import CorruptOnce
    from slipstream.weightsync.buckets import BucketPacker

    corrupt = CorruptOnce(version)
    monkeypatch.setattr(BucketPacker, "_close", corrupt.wrap(BucketPacker._close))
    return corrupt
