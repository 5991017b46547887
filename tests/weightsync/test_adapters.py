"""The exact HTTP sequences sent to SGLang 0.5.23 and vLLM 0.33, against fake servers on loopback.

The fake SGLang server is a real process that joins the trainer's gloo group and receives every
``flattened_bucket`` broadcast the way SGLang does (typed empties, concatenated, then views), so the test
checks both the request sequence and that the bytes land. The vLLM data plane is NCCL (GPU only), so the
vLLM adapter's requests are checked on their own; the live test is in test_gpu.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
import torch
from aiohttp import web
from fastapi import FastAPI, Request
from wsync_helpers import digest, mixed_tensors, spawn

from slipstream.serverkinds import server_kind
from slipstream.serverkinds.embedded import EmbeddedAdapter
from slipstream.serverkinds.sglang import SGLangAdapter
from slipstream.serverkinds.vllm import VLLMAdapter
from slipstream.utils.http_client import HTTPClient
from slipstream.utils.net import free_port
from slipstream.weightsync.adapters import GroupSpec
from slipstream.weightsync.buckets import BucketPacker, BufferPool, Layout, parse_dtype
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.publisher import WeightPublisher


def fake_sglang(port: int, die_on_update: int = 0) -> None:
    """SGLang's weight-update routes, recording every request; received tensors are kept by name.

    Like SGLang, a group stays registered under its name until it is destroyed (a second init of that
    name fails in torch), and destroy leaves without a barrier. ``die_on_update=n`` exits the process on
    the n-th update call."""
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
    updates = [0]

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
        updates[0] += 1
        if updates[0] == die_on_update:
            os._exit(1)
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
        await asyncio.to_thread(groups.pop(req["group_name"]).close, 0)
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
        pub = WeightPublisher(cfg, [url], server_kind("sglang"))
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
        http = HTTPClient(timeout_s=10)
        try:
            adapter = VLLMAdapter(f"http://127.0.0.1:{fake.port}", cfg, http)
            adapter.engine = "nccl"  # a server running vLLM's own engine (our plug-in: tests/vllm)
            ranks = await adapter.ranks()
            spec = GroupSpec(master_address="", master_port=0, rank_offset=1, world_size=1 + ranks,
                             group_name="g", backend="nccl", nccl_unique_id_b64="QUJD")  # fmt: skip
            await adapter.init_group(spec)
            await adapter.before(3)
            for meta in metas:
                await adapter.update(meta)
            await adapter.after(3)
            await adapter.destroy_group("g")
        finally:
            await http.aclose()

    try:
        asyncio.run(drive())
    finally:
        fake.close()
    pause_query = {"mode": vllm_mode, "clear_cache": "true"}  # every mode clears the prefix cache
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


def test_vllm_recovery_closes_the_update_session_and_resumes_only_whole_weights():
    fake = _Recorder()
    cfg = WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu", pause_mode="in_place")
    metas = metas_of(mixed_tensors(3), 3, Layout.vllm(1 << 20))

    async def drive():
        http = HTTPClient(timeout_s=10)
        try:
            adapter = VLLMAdapter(f"http://127.0.0.1:{fake.port}", cfg, http)
            adapter.engine = "nccl"  # a server running vLLM's own engine (our plug-in: tests/vllm)
            await adapter.before(3)
            await adapter.recover(3)  # failed before any byte: the weights are whole
            await adapter.before(3)
            await adapter.update(metas[0])
            await adapter.recover(3)  # part of version 3 landed
            await adapter.before(3)  # the retry from the publisher's kept copy
            for meta in metas:
                await adapter.update(meta)
            await adapter.after(3)
        finally:
            await http.aclose()

    try:
        asyncio.run(drive())
    finally:
        fake.close()
    calls = [(path, body) for _, path, _, body in fake.log if path != "/update_weights"]
    pause, start = ("/pause", b""), ("/start_weight_update", {})
    assert calls == [
        pause, start, ("/finish_weight_update", {}), ("/resume", b""),
        pause, start, ("/finish_weight_update", {}),  # session closed, kept paused: layers mix versions
        pause, start, ("/finish_weight_update", {"weight_version": "3"}), ("/resume", b""),
    ]  # fmt: skip


def _received(url: str) -> dict:
    return httpx.get(f"{url}/received").json()


def _calls(url: str) -> list[tuple[str, dict | None]]:
    return [
        (path, json.loads(body) if body else None) for _, path, _, body in httpx.get(f"{url}/requests").json()
    ]


def test_sglang_servers_that_survive_a_failed_push_take_the_retry_and_the_next_version():
    ports = [free_port(), free_port()]
    procs = [spawn(fake_sglang, ports[0]), spawn(fake_sglang, ports[1], 2)]
    live, doomed = (f"http://127.0.0.1:{p}" for p in ports)
    cfg = WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu")
    try:
        wait_up(live), wait_up(doomed)
        pub = WeightPublisher(cfg, [live, doomed], server_kind("sglang"))
        try:
            report = pub.publish(7, iter(mixed_tensors(7)))
            assert report.retried and report.ok == [live] and doomed in report.failed
            assert _received(live) == digest(mixed_tensors(7))
            assert pub.publish(8, iter(mixed_tensors(8))).ok == [live]
        finally:
            pub.close()
        assert _received(live) == digest(mixed_tensors(8))
        calls = _calls(live)
    finally:
        for proc in procs:
            proc.kill()
    joined = [body["group_name"] for path, body in calls if path == "/init_weights_update_group"]
    left = [body["group_name"] for path, body in calls if path == "/destroy_weights_update_group"]
    assert len(joined) == 2 and len(set(joined)) == 2  # the retry's group (kept for push 8) has a fresh name
    assert left[0] == joined[0]  # the survivor left the failed group at once
    pauses = [path for path, _ in calls if path in ("/pause_generation", "/continue_generation")]
    assert pauses == ["/pause_generation", "/continue_generation"] * 3  # never left paused


def test_a_push_that_fails_off_the_wire_leaves_no_server_paused_and_raises():
    port = free_port()
    proc = spawn(fake_sglang, port)
    url = f"http://127.0.0.1:{port}"

    def breaks():
        for i, item in enumerate(mixed_tensors(7)):
            if i == 3:
                raise RuntimeError("packing failed")
            yield item

    try:
        wait_up(url)
        pub = WeightPublisher(
            WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu"), [url], server_kind("sglang")
        )
        try:
            with pytest.raises(RuntimeError, match="packing failed"):
                pub.publish(7, breaks())
            assert pub.publish(8, iter(mixed_tensors(8))).ok == [url]
        finally:
            pub.close()
        assert _received(url) == digest(mixed_tensors(8))
        calls = [path for path, _ in _calls(url)]
    finally:
        proc.kill()
    first = calls[: calls.index("/continue_generation") + 1]
    assert first[2:4] == ["/pause_generation", "/begin_weight_update"]
    assert first[-2:] == ["/end_weight_update", "/continue_generation"]  # the session was closed, resumed
    assert calls.count("/pause_generation") == calls.count("/continue_generation") == 2


def test_unsupported_combinations_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown inference server kind `tgi`"):
        server_kind("tgi")  # the kind is resolved above weight sync, which takes the record
    with pytest.raises(ValueError, match="`nixl` is an in-band stream `sglang` servers do not take"):
        WeightPublisher(WeightSyncConfig(backend="nixl", device="cpu"), [], server_kind("sglang"))


def _control_calls(cls, pause_mode: str, fail_end: bool = False) -> list:
    """The control requests an adapter sends for one version (``fail_end``: the switch fails), as a
    server on loopback receives them."""
    sent: list = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        sent.append((request.path, dict(request.query), json.loads(body) if body else None))
        if fail_end and request.path == cls.api.weights.end.path:
            return web.json_response({"success": False, "message": "apply failed"}, status=500)
        return web.json_response({"success": True})

    async def drive():
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        http = HTTPClient(timeout_s=10)
        try:
            adapter = cls(
                f"http://127.0.0.1:{port}", WeightSyncConfig(device="cpu", pause_mode=pause_mode), http
            )
            await adapter.before(5)
            try:
                await adapter.after(5)
            except TransferError:
                await adapter.recover(5)
            return adapter.control.paused
        finally:
            await http.aclose()
            await runner.cleanup()

    assert asyncio.run(drive()) is None  # nothing is left paused
    return sent


def test_embedded_stages_while_generating_and_aborts_only_at_the_switch_in_one_call():
    begin = ("/begin_weight_update", {}, {"weight_version": 5})
    end = ("/end_weight_update", {}, {"weight_version": 5})
    assert _control_calls(EmbeddedAdapter, "in_place") == [begin, end]  # running requests keep going
    # the server pauses, aborts, switches and resumes inside the one call: no pause or continue is sent
    end_aborting = ("/end_weight_update", {}, {"weight_version": 5, "abort_running": True})
    assert _control_calls(EmbeddedAdapter, "abort") == [begin, end_aborting]
    assert _control_calls(EmbeddedAdapter, "retract") == [begin, end_aborting]  # its nearest: abort
    assert _control_calls(EmbeddedAdapter, "abort", fail_end=True) == [begin, end_aborting]


def test_adapters_pause_with_the_same_requests_as_the_clients():
    """One description, one control: weight sync's pause is the request a client's pause sends."""
    for cls in (SGLangAdapter, VLLMAdapter):
        for mode in ("in_place", "abort", "retract"):
            call = cls.api.pause_call(mode)
            # SGLang pauses first; vLLM with our engine stages while it generates and pauses at the switch.
            first = next(c for c in _control_calls(cls, mode) if c[0] == call.path)
            assert first == (call.path, dict(call.params), call.json)
            assert _control_calls(cls, mode)[-1][0] == cls.api.resume.path


def test_the_stream_a_version_travels_in_is_the_links_not_the_adapters():
    """The open link passes its stream to ``before``; the adapter keeps no transport name of its own."""
    adapter = EmbeddedAdapter("http://127.0.0.1:9", WeightSyncConfig(device="cpu", backend="nixl"), http=None)  # type: ignore[arg-type]
    assert adapter.begin_body(3, "ipc") == {"weight_version": 3, "stream": "ipc"}
    assert adapter.begin_body(3) == {"weight_version": 3}  # a group: buckets announced per call
    assert not hasattr(adapter, "transport")
    assert asyncio.run(adapter.data_plane()) == "torch_dist"
