"""The aiohttp client of the rollouter's and the publisher's server calls, against servers on loopback."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import uvicorn
from aiohttp import web

from slipstream.utils.http_client import HTTPClient, HTTPClientError, Reply, _unsent
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


async def _counting_server(drop_after_reading: bool) -> tuple[asyncio.Server, list[bytes]]:
    """A raw HTTP/1.1 server on loopback that records each request line it reads, then answers 200 with
    keep-alive, or (``drop_after_reading``) closes the connection without an answer."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = [
                    int(v)
                    for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:] if b":" in h)
                    if k.strip().lower() == b"content-length"
                ]
                await reader.readexactly(length[0] if length else 0)
                seen.append(head.split(b"\r\n", 1)[0])
                if drop_after_reading:
                    break
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), seen


def _close_reused_connections(http: HTTPClient) -> aiohttp.TraceConfig:
    """A trace that closes a pooled connection the moment the client takes it for a request: the request is
    then written to a closing transport, what a server's close racing the client's reuse looks like."""
    trace = aiohttp.TraceConfig()

    async def on_reuse(session, context, params) -> None:
        for proto in list(session.connector._acquired):  # aiohttp's own set of connections in use
            proto.transport.close()

    trace.on_connection_reuseconn.append(on_reuse)
    return trace


def test_a_repeatable_call_on_a_connection_closed_under_it_is_sent_once_more():
    """CI once failed an abort so: the pooled connection was closing as the request was written. Pause,
    resume and abort change nothing when sent twice, so the client sends them again on a fresh connection;
    the server saw the request once (the first never reached it)."""

    async def main():
        server, seen = await _counting_server(drop_after_reading=False)
        port = server.sockets[0].getsockname()[1]
        http = HTTPClient(f"http://127.0.0.1:{port}")
        session = http._open()
        session.trace_configs.append(_close_reused_connections(http))
        session.trace_configs[-1].freeze()
        try:
            first = await http.post("/pause", json={"mode": "keep"})
            second = await http.request(
                "POST", "/abort", json={"rid": "a"}, repeatable=True
            )  # closed as taken
        finally:
            await http.aclose()
            server.close()
        return first, second, seen

    first, second, seen = asyncio.run(main())
    assert first.status_code == second.status_code == 200
    assert seen == [b"POST /pause HTTP/1.1", b"POST /abort HTTP/1.1"]


def test_a_request_the_server_read_and_dropped_is_not_sent_again():
    """After the request went out, a dropped connection may mean the server acted on it: a call that is not
    repeatable (a weight update) gets no second try."""

    async def main():
        server, seen = await _counting_server(drop_after_reading=True)
        port = server.sockets[0].getsockname()[1]
        http = HTTPClient(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(HTTPClientError, match="ServerDisconnectedError"):
                await http.post("/update_weights", json={"version": 3})
        finally:
            await http.aclose()
            server.close()
        return seen

    assert asyncio.run(main()) == [b"POST /update_weights HTTP/1.1"]


def test_only_a_failure_to_write_the_request_counts_as_unsent():
    """What aiohttp raises when the request's own write fails (client_reqrep.py, "Can not write request
    body", caused by the socket's reset) is unsent; a refused connection or a reset after the request went out
    is not."""
    write = aiohttp.ClientOSError(None, "Can not write request body for http://x/abort")
    write.__cause__ = aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def refused() -> BaseException:
        http = HTTPClient(f"http://127.0.0.1:{free_port()}", connect_timeout_s=5)
        try:
            with pytest.raises(HTTPClientError) as info:
                await http.post("/abort", json={})
            return info.value.__cause__
        finally:
            await http.aclose()

    assert _unsent(write)
    assert not _unsent(asyncio.run(refused()))
    assert not _unsent(aiohttp.ServerDisconnectedError())
