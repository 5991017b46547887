"""The exact HTTP sequences sent to SGLang 0.5.23 and vLLM 0.33, against fake servers on loopback.

The fake SGLang server is a real process that joins the trainer's gloo group and receives every
``flattened_bucket`` broadcast the way SGLang does (typed empties, concatenated, then views), so the test
checks both the request sequence and that the bytes land. The vLLM data plane is NCCL (GPU only), so the
vLLM adapter's requests are checked on their own; the live test is in test_gpu.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from wsync_helpers import digest, mixed_tensors, spawn

from slipstream.utils.net import free_port
from slipstream.weightsync.adapters import GroupSpec, VLLMAdapter
from slipstream.weightsync.buckets import BucketPacker, BufferPool, Layout, parse_dtype
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher


def fake_sglang(port: int) -> None:
    """SGLang's weight-update routes, recording every request; received tensors are kept by name."""
    import uvicorn

    from slipstream.weightsync.groups import open_group

    torch.set_num_threads(1)
    app, log, groups, tensors = FastAPI(), [], {}, {}

    @app.middleware("http")
    async def record(request: Request, call_next):
        body = await request.body()
        if request.url.path not in ("/requests", "/received", "/health"):
            log.append([request.method, request.url.path, dict(request.query_params), body.decode() or None])
        return await call_next(request)

    ok = {"success": True, "message": "ok"}

    @app.get("/server_info")
    def server_info():
        return {"tp_size": 1, "dp_size": 1}

    @app.post("/init_weights_update_group")
    async def init(req: dict):
        groups[req["group_name"]] = await asyncio.to_thread(
            open_group, master_address=req["master_address"], master_port=req["master_port"],
            rank=req["rank_offset"], world_size=req["world_size"], group_name=req["group_name"],
            backend=req["backend"], timeout_s=30,
        )  # fmt: skip
        return ok

    @app.post("/update_weights_from_distributed")
    async def update(req: dict):
        typed = [
            torch.empty(s, dtype=parse_dtype(d)) for d, s in zip(req["dtypes"], req["shapes"], strict=True)
        ]
        flat = torch.empty(sum(t.numel() * t.element_size() for t in typed), dtype=torch.uint8)
        await asyncio.to_thread(groups[req["group_name"]].broadcast, flat, 30)
        offset = 0
        for name, t in zip(req["names"], typed, strict=True):
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + n])
            tensors[name], offset = t, offset + n
        return ok

    @app.post("/destroy_weights_update_group")
    async def destroy(req: dict):
        await asyncio.to_thread(groups.pop(req["group_name"]).close, 10)
        return ok

    for path in ("/pause_generation", "/begin_weight_update", "/end_weight_update", "/continue_generation"):
        app.add_api_route(path, lambda: ok, methods=["POST"])
    app.add_api_route("/health", lambda: {}, methods=["GET"])
    app.add_api_route("/requests", lambda: log, methods=["GET"])
    app.add_api_route("/received", lambda: digest(tensors), methods=["GET"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(url)


def metas_of(named, version: int, layout: Layout):
    """The bucket metadata the publisher will produce for ``named``."""
    pool, metas = BufferPool("cpu"), []
    for bucket in BucketPacker(named, version, layout, pool, timeout_s=5):
        metas.append(bucket.meta)
        pool.release(bucket.slot)
    return metas


@pytest.mark.parametrize("pause_mode", ["in_place", "abort"])
def test_sglang_gets_pause_begin_flattened_buckets_end_continue_and_every_byte(pause_mode):
    port = free_port()
    proc = spawn(fake_sglang, port)
    url = f"http://127.0.0.1:{port}"
    cfg = WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu", pause_mode=pause_mode)
    try:
        wait_up(url)
        pub = WeightPublisher(cfg, [url], "sglang")
        try:
            assert pub.publish(7, iter(mixed_tensors(7))).ok == [url]
        finally:
            pub.close()
        log = httpx.get(f"{url}/requests").json()
        assert httpx.get(f"{url}/received").json() == digest(mixed_tensors(7))
    finally:
        proc.kill()
    calls = [(method, path) for method, path, _, _ in log]
    metas = metas_of(mixed_tensors(7), 7, Layout.sglang(1 << 20))
    assert calls == [
        ("GET", "/server_info"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/pause_generation"),
        ("POST", "/begin_weight_update"),
        *[("POST", "/update_weights_from_distributed")] * len(metas),
        ("POST", "/end_weight_update"),
        ("POST", "/continue_generation"),
        ("POST", "/destroy_weights_update_group"),
    ]
    bodies = [httpx.Response(200, content=b or b"null").json() for _, _, _, b in log]
    init = bodies[1]
    assert init == {
        "master_address": "127.0.0.1",
        "master_port": init["master_port"],
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "slipstream_weights",
        "backend": "gloo",
    }
    assert bodies[2] == {"mode": pause_mode} and bodies[3] == {}
    updates = bodies[4 : 4 + len(metas)]
    for body, meta in zip(updates, metas, strict=True):
        assert body == {
            "names": [e.name for e in meta.entries],
            "dtypes": [e.dtype for e in meta.entries],
            "shapes": [e.shape for e in meta.entries],
            "group_name": "slipstream_weights",
            "weight_version": "7",
            # never while in-place-paused requests hold the cache; after an abort, once, at the end
            "flush_cache": pause_mode == "abort" and meta.last,
            "load_format": "flattened_bucket",
        }
    assert bodies[-1] == {"group_name": "slipstream_weights"}


class _Recorder:
    """A fake vLLM server in a thread of this process (the adapter's HTTP calls only; no data plane)."""

    def __init__(self) -> None:
        import uvicorn

        self.log: list = []
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_route(path: str, request: Request):
            body = await request.body()
            self.log.append(
                (
                    request.method,
                    "/" + path,
                    dict(request.query_params),
                    body and httpx.Response(200, content=body).json(),
                )
            )
            return {"world_size": 2} if path == "get_world_size" else {"status": "ok"}

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.mark.parametrize("pause_mode,vllm_mode", [("in_place", "keep"), ("abort", "abort")])
def test_vllm_gets_init_pause_start_packed_updates_finish_resume(pause_mode, vllm_mode):
    fake = _Recorder()
    cfg = WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu", pause_mode=pause_mode)
    named = mixed_tensors(3)
    metas = metas_of(named, 3, Layout.vllm(1 << 20))

    async def drive():
        async with httpx.AsyncClient() as http:
            adapter = VLLMAdapter(f"http://127.0.0.1:{fake.port}", cfg, http)
            ranks = await adapter.ranks()
            spec = GroupSpec(master_address="", master_port=0, rank_offset=1, world_size=1 + ranks,
                             group_name="g", backend="nccl", nccl_unique_id_b64="QUJD")  # fmt: skip
            await adapter.init_group(spec)
            await adapter.before(3)
            for meta in metas:
                await adapter.update(meta)
            await adapter.after(3)
            await adapter.destroy_group("g")

    try:
        asyncio.run(drive())
    finally:
        fake.close()
    pause_query = {"mode": vllm_mode, **({"clear_cache": "true"} if vllm_mode == "abort" else {})}
    assert fake.log == [
        ("GET", "/get_world_size", {"include_dp": "true"}, b""),
        ("POST", "/init_weight_transfer_engine", {}, {"init_info": {
            "rank_offset": 1, "world_size": 3, "nccl_unique_id_b64": "QUJD", "packed": True,
            "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}}),
        ("POST", "/pause", pause_query, b""),
        ("POST", "/start_weight_update", {}, {}),
        *[("POST", "/update_weights", {}, {"update_info": {
            "names": [e.name for e in m.entries], "dtype_names": [e.dtype for e in m.entries],
            "shapes": [e.shape for e in m.entries]}}) for m in metas],
        ("POST", "/finish_weight_update", {}, {"weight_version": "3"}),
        ("POST", "/resume", {}, b""),
        ("POST", "/shutdown_weight_transfer_engine", {}, {}),
    ]  # fmt: skip


def test_unsupported_combinations_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown server kind `tgi`"):
        WeightPublisher(WeightSyncConfig(device="cpu"), [], "tgi")
    with pytest.raises(ValueError, match="`nixl` works with embedded servers only"):
        WeightPublisher(WeightSyncConfig(backend="nixl", device="cpu"), [], "sglang")
