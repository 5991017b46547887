"""Which requests the embedded server serves to whom: the bearer-token gate in front of every route.

Policy (the token comes from ``$SLIPSTREAM_SERVER_TOKEN`` or ``build_app(token=...)``, see
:mod:`slipstream.utils.http_auth`):

=============================================  ==================================  ==========================
route                                          bound to loopback                   bound beyond loopback
=============================================  ==================================  ==========================
``GET /health``                                open                                open
generation and read-only routes                open                                token
(:data:`READ_PATHS`: ``/generate``, ``/v1/*``,
``/model_info``, ``/weightsync/status``)
everything else: pause/continue, abort, the    token (open when no token is set)   token (a token is required
weight-group and weight-update routes, NIXL                                        to start at all)
rendezvous, and any route added later
=============================================  ==================================  ==========================

The gate denies by default: a route is open only when its exact path is listed here, so a control route
added later is guarded without anyone remembering to guard it. Aborting a request is control, so no
client can abort another's request without the token.

A missing or malformed ``Authorization`` header gets 401 (with ``WWW-Authenticate: Bearer``), a wrong token
403, both before the body is read. ``build_app`` with no token keeps every route open on loopback, as SGLang
and vLLM do; ``slipstream serve`` without ``$SLIPSTREAM_SERVER_TOKEN`` makes a random token and prints it, and
runs open only with ``--open`` (what the launcher passes when its caller gave no token); the pipeline always
sets one.

The gate is a plain ASGI middleware rather than FastAPI dependencies so that it also covers the routers
other modules contribute (the OpenAI routes, the weight-sync receiver) and streaming responses untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from slipstream.utils.http_auth import token_matches

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]

ALWAYS_OPEN = frozenset({"/health"})
READ_PATHS = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/model_info",
        "/weightsync/status",
    }
)


class TokenGate:
    """ASGI middleware: requests to guarded routes must carry ``Authorization: Bearer <token>``.

    ``open_reads`` is true for a server bound to loopback (generation and reads need no token there).
    With an empty ``token`` nothing is guarded (only allowed on loopback; ``check_bind`` refuses the rest).
    """

    def __init__(self, app: ASGIApp, *, token: str, open_reads: bool) -> None:
        self.app = app
        self.token = token
        self.open = ALWAYS_OPEN | READ_PATHS if open_reads else ALWAYS_OPEN

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or not self.token or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        if token_matches(header, self.token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        elif not header.lower().startswith("bearer "):
            await _deny(
                send, 401, f"{scope['path']} needs `Authorization: Bearer <token>` (the server's token)"
            )
        else:
            await _deny(send, 403, f"{scope['path']}: the token does not match this server's")


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


async def _deny(send: Callable, status: int, message: str) -> None:
    kind = "authentication_error" if status == 401 else "permission_error"
    body = msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
