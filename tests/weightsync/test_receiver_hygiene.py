"""The weight receiver keeps its promises about time and memory.

* Joining a group whose master is gone gives up within the request's ``timeout_s`` and frees the weight
  lock (torch's store client used to try twice, and a listener that never answers held it forever).
* A version that is refused frees what it staged: one with a name the target does not serve (refused by
  ``apply_weights`` at the end) and one older than the serving version (refused before any byte lands).

The init tests run the receiver in this process behind a real HTTP server (uvicorn on a background event
loop) and look at its weight lock; the staging tests need a real group with the publisher, so the receiver
runs in a child process that shows its staging memory at ``GET /staging``.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
import torch
from wsync_helpers import DictTarget, mixed_tensors, spawn

from slipstream.serverkinds import server_kind
from slipstream.utils.net import free_port
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.http_receiver import WeightReceiver
from slipstream.weightsync.publisher import WeightPublisher


class ReceiverServer:
    """A WeightReceiver for a DictTarget behind uvicorn on 127.0.0.1, on a loop in a background thread."""

    def __init__(self) -> None:
        import uvicorn
        from fastapi import FastAPI

        self.target = DictTarget(mixed_tensors(0))
        self.receiver = WeightReceiver(self.target, WeightSyncConfig(device="cpu", timeout_s=30))
        app = FastAPI()
        app.include_router(self.receiver.router())
        app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        started = threading.Event()
        while not self.server.started:
            assert not self.serving.done(), self.serving.result()
            started.wait(0.05)

    def on_loop(self, fn):
        """Run ``fn()`` on the server's loop (the receiver's state belongs to it) and return its result."""

        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(60)

    def close(self) -> None:
        self.server.should_exit = True
        self.serving.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture
def server():
    s = ReceiverServer()
    yield s
    s.close()


def init_body(port: int, timeout_s: float) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo", "timeout_s": timeout_s}  # fmt: skip


def lock_is_free(server: ReceiverServer) -> bool:
    return not server.on_loop(lambda: server.receiver._lock.locked())


@pytest.mark.timeout(120)
def test_an_init_at_a_dead_port_gives_up_names_the_cause_and_frees_the_lock(server):
    dead = socket.socket()  # bound, never listening: connections are refused and nobody else takes the port
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    try:
        r = httpx.post(f"{server.url}/init_weights_update_group", json=init_body(port, 1.0), timeout=60)
    finally:
        dead.close()
    assert r.status_code == 500 and r.json()["success"] is False
    assert f"nothing listens on 127.0.0.1:{port}" in r.json()["message"]
    assert lock_is_free(server)
    assert httpx.post(f"{server.url}/begin_weight_update", json={"weight_version": 1}, timeout=10).json()[
        "success"
    ]  # the next weight operation runs at once
    assert server.on_loop(lambda: sorted(server.receiver.groups)) == []


@pytest.mark.timeout(120)
def test_an_init_at_a_listener_that_never_answers_gives_up_too(server):
    silent = socket.socket()  # accepts connections in the kernel, never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        body = init_body(silent.getsockname()[1], 1.0)
        r = httpx.post(f"{server.url}/init_weights_update_group", json=body, timeout=60)
        assert r.status_code == 500 and "did not answer as a TCPStore" in r.json()["message"]
        assert lock_is_free(server)
    finally:
        silent.close()  # the abandoned store handshake ends with the connection


def serve_receiver(port: int, version: int) -> None:
    """A receiver in a child process (a process group cannot have both ends in one process), with a view of
    its staging memory at ``GET /staging``."""
    import uvicorn

    torch.set_num_threads(1)
    app = build_receiver_app(DictTarget(mixed_tensors(0), version=version))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def build_receiver_app(target: DictTarget):
    from fastapi import FastAPI

    receiver = WeightReceiver(target, WeightSyncConfig(device="cpu", timeout_s=30))
    app = FastAPI()
    app.include_router(receiver.router())
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])

    def staging() -> dict:
        return {"session": receiver.session is not None, "areas": len(receiver._staging),
                "applied": target.applied, "version": target.weight_version}  # fmt: skip

    app.add_api_route("/staging", staging, methods=["GET"])
    return app


@pytest.fixture
def child_server():
    procs = []

    def start(version: int = 0) -> str:
        port = free_port()
        procs.append(spawn(serve_receiver, port, version))
        url = f"http://127.0.0.1:{port}"
        while True:  # bounded by the test's timeout
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                assert procs[-1].is_alive(), "the receiver process exited"
                threading.Event().wait(0.1)

    yield start
    for proc in procs:
        proc.kill()
        proc.join(timeout=10)


def staging(url: str) -> dict:
    return httpx.get(f"{url}/staging", timeout=10).json()


def publisher(url: str) -> WeightPublisher:
    cfg = WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=30, device="cpu", keep_last=False)
    return WeightPublisher(cfg, [url], server_kind("embedded"), token="")


@pytest.mark.timeout(180)
def test_a_version_with_an_unknown_name_is_refused_and_frees_what_it_staged(child_server):
    url = child_server()
    pub = publisher(url)
    try:
        stray = ("not.a.parameter", torch.randn(1 << 20))  # 4 MiB the target has no place for
        report = pub.publish(1, iter([*mixed_tensors(1), stray]))
    finally:
        pub.close()
    assert report.ok == [] and "not.a.parameter" in report.failed[url]
    assert staging(url) == {"session": False, "areas": 0, "applied": [], "version": 0}
    assert httpx.get(f"{url}/weightsync/status", timeout=10).json()["failed_versions"] == 1


@pytest.mark.timeout(180)
def test_a_version_older_than_the_serving_one_is_refused_before_anything_is_staged(child_server):
    url = child_server(version=5)
    pub = publisher(url)
    try:
        report = pub.publish(3, iter(mixed_tensors(3)))
        assert report.ok == [] and "older than the serving version 5" in report.failed[url]
        assert staging(url) == {"session": False, "areas": 0, "applied": [], "version": 5}
        assert pub.publish(6, iter(mixed_tensors(6))).ok == [url]  # a newer one still goes through
        assert staging(url)["applied"] == [6]
    finally:
        pub.close()


def test_leaving_a_group_meets_no_barrier_the_trainer_never_joins():
    import asyncio

    from slipstream.weightsync.types import DestroyWeightsUpdateGroupReq

    class Group:
        closed_with: list[float] = []

        def close(self, barrier_timeout_s: float = 10.0) -> None:
            self.closed_with.append(barrier_timeout_s)

    receiver = WeightReceiver(DictTarget(mixed_tensors(0)), WeightSyncConfig(device="cpu", timeout_s=30))
    receiver.groups["w"] = group = Group()
    reply = asyncio.run(receiver.destroy_group(DestroyWeightsUpdateGroupReq(group_name="w")))
    assert reply.success and group.closed_with == [0] and "w" not in receiver.groups
