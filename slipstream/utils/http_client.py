"""The HTTP client of the hot paths that talk to inference servers: one per server, on aiohttp.

Who uses it: the weight publisher's adapters (every server gets a handful of small calls per push, all at
once, from trainer rank 0's process) and the rollouter's server clients (every request, abort and resume
of a run). At hundreds of servers the client's CPU per call is the push, and a large share of the
rollouter's loop. Measured on one core (a loopback aiohttp server in the same process, 2,000 sequential
POSTs with a small JSON body and a JSON answer): httpx 0.28 780 µs per call, aiohttp 3.14 216 µs, server
included. aiohttp is already installed with ``ray[default]``.

What it is: a thin shell over ``aiohttp.ClientSession`` that answers :class:`Reply` (status and body, read
whole) and raises :class:`HTTPClientError` for anything that is not an HTTP answer (refused, reset, timed
out), so callers handle one error type. Keep-alive connections (up to ``max_connections``), each dropped
after ``keepalive_s`` idle (2 s): below the 5 s after which uvicorn, which serves vLLM, SGLang and our
embedded server, closes an idle connection. aiohttp's own default is 15 s, and a request sent on a
connection the server had just closed failed with ``ServerDisconnectedError`` and got the server marked
dead (POSTs are not retried). A connection the server closes anyway (seen once on a loaded 2-core machine,
within the 2 s) fails while the request is being written: the server cannot have acted on a request it
never read whole, so that one case is sent again, once, on a fresh connection (:func:`_unsent`); a failure
after the request went out is never retried. An optional
``Authorization: Bearer`` token on every call, no proxy from the environment (these calls go to the
cluster's own servers). The session is opened on the first call, so a client can be made outside the
event loop it will be used in (but used in one loop only).

Example::

    http = HTTPClient("http://127.0.0.1:30000", token="s3cret", timeout_s=30)
    reply = await http.request("POST", "/end_weight_update", json={"weight_version": 7})
    reply.status_code, reply.json()                      # 200, {"success": True, ...}
    await http.aclose()
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from slipstream.utils.http_auth import bearer_headers

_decode = msgspec.json.Decoder()


def _drop_connection(resp: aiohttp.ClientResponse) -> None:
    """Close the socket a 5xx reply came on. uvicorn drops the connection after an exception in the app
    (vLLM's failed ``collective_rpc`` calls end so), but the 500 it sent first hands the connection back
    to the pool as reusable, and the next request on it is reset. By the time the body is read the pool
    holds it again (``resp.connection`` is None), so the response's own handler is closed: the pool skips
    closed connections. ``_protocol`` is aiohttp's (3.9-3.14); without it the next call may be reset."""
    handler = resp.connection.protocol if resp.connection is not None else getattr(resp, "_protocol", None)
    if handler is not None:
        handler.close()


def _unsent(err: BaseException) -> bool:
    """True when ``err`` is aiohttp's failure to write the request itself (its "Can not write request body",
    raised from the socket's own reset or broken pipe): the server never got the whole request."""
    cause = err.__cause__
    return (
        isinstance(err, aiohttp.ClientOSError)
        and not isinstance(err, aiohttp.ClientConnectorError)
        and isinstance(cause, (ConnectionResetError, BrokenPipeError))
    )


class HTTPClientError(Exception):
    """The call got no HTTP answer: connection refused or reset, or no answer within its time-out."""


@dataclass(frozen=True)
class Reply:
    status_code: int
    content: bytes
    reason: str = ""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` when it is not."""
        try:
            return _decode.decode(self.content)
        except msgspec.DecodeError as err:
            raise ValueError(str(err)) from err


class HTTPClient:
    """Keep-alive calls to one server (module docstring). ``url`` in :meth:`request` is a path below
    ``base_url`` (when given) or a whole URL."""

    def __init__(
        self,
        base_url: str = "",
        *,
        token: str = "",
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 100,
        keepalive_s: float = 2.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.headers: dict[str, str] = bearer_headers(token)
        self._session: aiohttp.ClientSession | None = None

    def set_token(self, token: str) -> None:
        """Send ``token`` with every call from now on ("" sends none)."""
        self.headers = bearer_headers(token)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=0, keepalive_timeout=self.keepalive_s
                ),
                json_serialize=lambda obj: msgspec.json.encode(obj).decode(),
                trust_env=False,
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
        repeatable: bool = False,
    ) -> Reply:
        """One request, its body read whole. ``repeatable`` (a call that changes nothing when sent twice):
        also sent once more when the server drops the connection before answering."""
        if url.startswith("/"):
            url = self.base_url + url
        limit = aiohttp.ClientTimeout(
            total=self.timeout_s if timeout is None else timeout, sock_connect=self.connect_timeout_s
        )
        try:
            async with await self._send(method, url, json, params, limit, repeatable) as resp:
                reply = Reply(resp.status, await resp.read(), resp.reason or "")
                if resp.status >= 500:
                    _drop_connection(resp)
                return reply
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HTTPClientError(f"{type(err).__name__}: {err or 'timed out'}") from err

    async def _send(
        self,
        method: str,
        url: str,
        json: Any,
        params: dict[str, str] | None,
        limit: aiohttp.ClientTimeout,
        repeatable: bool = False,
    ) -> aiohttp.ClientResponse:
        """The response's head, the request sent once more when it never got out whole (:func:`_unsent`) or,
        ``repeatable``, when the server dropped the connection without an answer."""
        try:
            return await self._open().request(
                method, url, json=json, params=params, timeout=limit, headers=self.headers
            )
        except aiohttp.ClientOSError as err:
            if not _unsent(err):
                raise
        except aiohttp.ServerDisconnectedError:
            if not repeatable:
                raise
        return await self._open().request(
            method, url, json=json, params=params, timeout=limit, headers=self.headers
        )

    async def stream_lines(
        self, method: str, url: str, *, json: Any = None, timeout: float | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """``(status, line)`` for each line of the response body as it arrives (an SSE stream); a status of 400
        or more comes with the whole body as its one line."""
        if url.startswith("/"):
            url = self.base_url + url
        limit = aiohttp.ClientTimeout(
            total=self.timeout_s if timeout is None else timeout, sock_connect=self.connect_timeout_s
        )
        try:
            async with await self._send(method, url, json, None, limit) as resp:
                if resp.status >= 400:
                    body = await resp.read()
                    if resp.status >= 500:
                        _drop_connection(resp)
                    yield resp.status, body
                    return
                buffer = b""  # split by hand: aiohttp's line reader refuses lines over 64 KiB
                async for data in resp.content.iter_any():
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        yield resp.status, line
                if buffer:
                    yield resp.status, buffer
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HTTPClientError(f"{type(err).__name__}: {err or 'timed out'}") from err

    async def get(self, url: str, *, timeout: float | None = None) -> Reply:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, *, json: Any = None, timeout: float | None = None) -> Reply:
        return await self.request("POST", url, json=json, timeout=timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
