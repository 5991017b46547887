"""Who may control a vLLM server: holders of the run's token (rollouter/vllm_auth.py, vLLM's ``--middleware``).

The gate is driven as a bare ASGI app (scopes as uvicorn builds them) and behind a real uvicorn with raw
HTTP requests, so each path trick reaches it exactly as it would reach vLLM; tests/vllm/test_vllm_server_token.py
runs it inside a real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib
import inspect
import json
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from slipstream.rollouter.vllm_auth import TokenGate, TokenRequired, is_open
from slipstream.utils.http_auth import TOKEN_ENV, bearer_headers, new_token
from slipstream.utils.net import free_port

TOKEN = new_token()

# Every route of vLLM 0.32's dev mode (with --enable-scale-out) that changes its state, and a few reads.
STATE_CHANGING = [
    "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_checker",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/scale_elastic_ep", "/is_scaling_elastic_ep", "/invocations",
    "/v1/load_lora_adapter", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate",
    "/start_profile", "/stop_profile",
]  # fmt: skip
READS = ["/metrics", "/v1/models", "/is_paused", "/weight_info", "/server_info", "/get_world_size", "/load"]
# Requests that must not pass for GET /health: (method, raw target as sent on the wire).
PATH_TRICKS = [
    ("POST", "//pause"), ("POST", "/pause/"), ("POST", "/%70ause"), ("POST", "/./pause"),
    ("POST", "/health/../pause"), ("POST", "/health%2F..%2Fpause"), ("POST", "/health/%2e%2e/pause"),
    ("POST", "/PAUSE"), ("POST", "/pause."), ("POST", "/pause?mode=keep"), ("POST", "/health"),
    ("POST", "/health?/pause"), ("GET", "/health/"), ("GET", "//health"), ("GET", "/%68ealth"),
    ("GET", "/HEALTH"), ("GET", "/health."), ("GET", "/health;x"), ("GET", "/./health"),
    ("PUT", "/health"), ("OPTIONS", "/pause"), ("GET", "http://127.0.0.1/pause"),
]  # fmt: skip


def scope(path: str, method: str = "POST", *, raw: bytes | None = None, headers=(), client=("127.0.0.1", 5)):
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": raw if raw is not None else path.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in dict(headers).items()],
        "client": client,
    }


async def call(gate_cls, s: dict, token: str | None = TOKEN) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the inner app ran) of one request through the gate."""
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    await gate_cls(inner, token=token)(s, receive, send)
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]) or b"{}")
    return sent[0]["status"], body, bool(reached)


def outcome(gate_cls, s: dict, token: str | None = TOKEN) -> tuple[int, dict, bool]:
    return asyncio.run(call(gate_cls, s, token))


@pytest.mark.parametrize("gate", [TokenGate, TokenRequired])
def test_every_state_changing_route_and_read_needs_the_token(gate):
    for path in STATE_CHANGING + READS:
        method = "GET" if path in READS else "POST"
        bare = outcome(gate, scope(path, method))
        wrong = outcome(gate, scope(path, method, headers=bearer_headers(new_token())))
        basic = outcome(gate, scope(path, method, headers={"Authorization": f"Basic {TOKEN}"}))
        good = outcome(gate, scope(path, method, headers=bearer_headers(TOKEN)))
        assert bare[0] == 401 and not bare[2], (path, bare)
        assert bare[1]["error"]["type"] == "authentication_error" and path in bare[1]["error"]["message"]
        assert wrong[0] == 403 and not wrong[2] and wrong[1]["error"]["code"] == 403, (path, wrong)
        assert basic[0] == 401 and not basic[2], (path, basic)
        assert good == (200, {}, True), (path, good)


def test_401_says_how_to_authenticate():
    sent = []

    async def send(message):
        sent.append(message)

    async def main():
        await TokenGate(lambda *a: None, token=TOKEN)(scope("/pause"), None, send)

    asyncio.run(main())
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 401 and headers[b"www-authenticate"] == b"Bearer"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(sent[1]["body"])


def test_only_get_health_is_open_exactly():
    assert outcome(TokenGate, scope("/health", "GET")) == (200, {}, True)
    assert outcome(TokenGate, scope("/health", "GET", raw=b"/health?probe=1"))[2]  # a query changes no route
    assert is_open(scope("/health", "HEAD"))
    # uvicorn decodes %-escapes into `path` but keeps `raw_path`: the raw one must be /health too
    assert not is_open(scope("/health", "GET", raw=b"/%68ealth"))
    assert not is_open({**scope("/health", "GET"), "type": "websocket"})
    for method, target in PATH_TRICKS:
        raw = target.encode()
        for s in (scope(target.split("?")[0], method, raw=raw), scope("/pause", method, raw=raw)):
            status, _, reached = outcome(TokenGate, s)
            assert status == 401 and not reached, (method, target)


def test_without_a_token_loopback_is_served_and_other_machines_are_not():
    for client in [("127.0.0.1", 5), ("::1", 5), None]:
        assert outcome(TokenGate, scope("/pause", client=client), token="")[2], client
    status, body, reached = outcome(TokenGate, scope("/pause", client=("10.1.2.3", 5)), token="")
    assert status == 403 and not reached and TOKEN_ENV in body["error"]["message"]
    status, _, reached = outcome(TokenRequired, scope("/pause"), token="")
    assert status == 401 and not reached
    assert outcome(TokenRequired, scope("/health", "GET"), token="")[2]


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert TokenGate(lambda *a: None).token == TOKEN
    monkeypatch.delenv(TOKEN_ENV)
    assert TokenRequired(lambda *a: None).token == ""


def test_websockets_are_closed_without_the_token():
    sent = []

    async def send(message):
        sent.append(message)

    async def main():
        s = {**scope("/v1/realtime", "GET"), "type": "websocket"}
        await TokenGate(lambda *a: None, token=TOKEN)(s, None, send)

    asyncio.run(main())
    assert sent == [{"type": "websocket.close", "code": 1008}]


def vllm_like_app(token: str | None, gate=TokenGate) -> tuple[FastAPI, list[str]]:
    """Routes shaped like vLLM's dev mode; vLLM adds its --middleware class the same way."""
    app, changed = FastAPI(), []
    app.get("/health")(lambda: {})
    for path in ("/pause", "/update_weights", "/abort_requests"):
        app.post(path)(lambda path=path: changed.append(path) or {})
    app.add_middleware(gate, token=token)
    return app, changed


class Served:
    def __init__(self, app) -> None:
        self.port = free_port("127.0.0.1")
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="auto")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def request(self, method: str, target: str, headers: dict | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, target, body=b"{}", headers=headers or {})
            return conn.getresponse().status
        finally:
            conn.close()


def test_path_tricks_over_http_never_reach_a_route():
    app, changed = vllm_like_app(TOKEN)
    with Served(app) as served:
        tricks = {f"{m} {t}": served.request(m, t) for m, t in PATH_TRICKS}
        health = served.request("GET", "/health")
        with_token = served.request("POST", "/pause", bearer_headers(TOKEN))
    assert set(tricks.values()) == {401}, tricks
    assert health == 200 and with_token == 200 and changed == ["/pause"]


def test_a_server_beyond_loopback_without_a_token_does_not_start():
    app, _ = vllm_like_app("", gate=TokenRequired)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port("127.0.0.1"), lifespan="auto")
    server = uvicorn.Server(config)
    with contextlib.suppress(SystemExit):  # uvicorn 0.36+ exits with code 3; older ones return
        asyncio.run(asyncio.wait_for(server.serve(), 30))
    assert not server.started


def test_vllm_adds_the_gate_as_a_class_and_it_imports_nothing_heavy(monkeypatch):
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.serverkinds import vllm as vllm_kind

    monkeypatch.setattr(vllm_kind, "vllm_build", lambda: "cpu")
    for host, name in [("127.0.0.1", "TokenGate"), ("localhost", "TokenGate"), ("0.0.0.0", "TokenRequired"),
                       ("10.0.0.7", "TokenRequired"), ("::", "TokenRequired")]:  # fmt: skip
        cmd = vllm_kind.vllm_command("/m", host, 8000, RolloutConfig(backend="vllm"))
        path = cmd[cmd.index("--middleware") + 1]
        module, _, attr = path.rpartition(".")
        assert attr == name and inspect.isclass(getattr(importlib.import_module(module), attr)), host
    code = "import sys, slipstream.rollouter.vllm_auth; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not any(f"'{heavy}'" in loaded for heavy in ("torch", "msgspec", "fastapi", "aiohttp", "httpx"))
