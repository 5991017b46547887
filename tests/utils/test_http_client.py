"""The aiohttp client of the rollouter's and the publisher's server calls, against servers on loopback."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from aiohttp import web

from slipstream.utils.http_client import HTTPClient, HTTPClientError, Reply
from slipstream.utils.net import free_port


def test_replies_errors_and_the_token_reach_the_caller():
    seen: list[tuple[str, str, dict, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.text()
        seen.append((request.method, request.path, dict(request.query), request.headers.get("Authorization")))
        if request.path == "/broken":
            return web.Response(status=500, text="not json")
        return web.json_response({"echo": body})

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        http = HTTPClient(f"http://127.0.0.1:{port}", token="s3cret")
        try:
            ok = await http.request("POST", "/a", json={"x": [1, 2]}, params={"mode": "keep"})
            http.set_token("")
            broken = await http.get("/broken")
            whole = await http.post(f"http://127.0.0.1:{port}/b", json=None)
        finally:
            await http.aclose()
            await runner.cleanup()
        refused = HTTPClient(f"http://127.0.0.1:{free_port()}", connect_timeout_s=5)
        try:
            with pytest.raises(HTTPClientError, match="ClientConnectorError"):
                await refused.get("/health")
        finally:
            await refused.aclose()
        return ok, broken, whole

    ok, broken, whole = asyncio.run(main())
    assert ok.status_code == 200 and ok.json() == {"echo": '{"x":[1,2]}'}
    assert broken.status_code == 500 and broken.text == "not json"
    with pytest.raises(ValueError):
        broken.json()
    assert whole.json() == {"echo": ""}  # no body for json=None
    assert seen == [
        ("POST", "/a", {"mode": "keep"}, "Bearer s3cret"),
        ("GET", "/broken", {}, None),
        ("POST", "/b", {}, None),
    ]
    assert Reply(204, b"").text == ""


def test_idle_connections_are_dropped_before_uvicorn_drops_them():
    """uvicorn (vLLM, SGLang, our embedded server) closes a connection idle for 5 s; a client that kept it
    longer could send a request on a connection the server had just closed (ServerDisconnectedError, and the
    balancer would mark the server dead). The client lets idle connections go first."""
    server_keepalive = uvicorn.Config(app=None).timeout_keep_alive

    async def keepalive() -> float:
        http = HTTPClient()
        try:
            return http._open().connector._keepalive_timeout  # type: ignore[union-attr]
        finally:
            await http.aclose()

    assert HTTPClient().keepalive_s == asyncio.run(keepalive()) < server_keepalive
