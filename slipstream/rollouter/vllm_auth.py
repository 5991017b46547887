"""The bearer-token gate a vLLM server runs in front of every route (``--middleware``, passed by the launcher).

Why: Slipstream runs vLLM in dev mode (``VLLM_SERVER_DEV_MODE=1``: pause, abort and the weight-transfer
routes exist only there), and dev mode serves those routes to anyone who reaches the port. vLLM's own
``--api-key`` does not help: its middleware guards only paths starting ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``, 0.32 and 0.33 alike), so ``/pause``,
``/abort_requests``, ``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``, ``/sleep``
and the rest stay open. vLLM's ``--middleware`` takes an ASGI middleware by import path; a class is added
with ``app.add_middleware`` after vLLM's own middleware and routers (``serve/middleware/register.py``, 0.32
and 0.33), which makes it the outermost: it sees every request, of every router, before anything else.

Policy (the token is the run's ``$SLIPSTREAM_SERVER_TOKEN``, which the launcher puts in the server's
environment, never on its command line):

* with a token, every request must present it as ``Authorization: Bearer <token>`` (compared in constant
  time), except ``GET``/``HEAD`` of exactly ``/health`` (the launcher's and the pipeline's health checks).
  Generation, ``/metrics`` and ``/v1/models`` need it too: Slipstream's clients send it on every call. A
  missing or malformed header gets 401 (``WWW-Authenticate: Bearer``), a wrong token 403, both before the
  body is read, as from the embedded server (``rollouter/embedded/auth.py``);
* without one, :class:`TokenGate` (what ``vllm_command`` passes for a server bound to loopback) serves
  connections from this machine only, and answers 403 to any other; :class:`TokenRequired` (passed for a
  server bound beyond loopback) refuses to start: its ASGI lifespan start-up fails, uvicorn exits with the
  message, and the launcher reports it with the server's output. A request that reaches it anyway gets 401.

Path tricks: a request is open only when its method is ``GET`` or ``HEAD``, its decoded path is exactly
``/health`` and so is its raw path (query string aside). ``//pause``, ``/pause/``, ``/%70ause``,
``/./pause``, ``/health/../pause``, ``/health%2F..%2Fpause``, ``/HEALTH``, ``/health.`` and a ``POST
/health`` therefore all need the token, whatever vLLM's router makes of them: the gate denies by default,
so a route vLLM adds later is guarded without anyone listing it.

This module imports only the standard library and :mod:`slipstream.utils.http_auth`: it is imported inside
vLLM's API server process.

Example (what ``slipstream.serverkinds.vllm.vllm_command`` adds)::

    SLIPSTREAM_SERVER_TOKEN=... python -m vllm.entrypoints.openai.api_server --model M --host 0.0.0.0 \\
        --middleware slipstream.rollouter.vllm_auth.TokenRequired
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar

from slipstream.utils.http_auth import TOKEN_ENV, env_token, token_matches
from slipstream.utils.net import is_loopback

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]

OPEN_PATH = "/health"
OPEN_METHODS = frozenset({"GET", "HEAD"})


def is_open(scope: Scope) -> bool:
    """Whether a request may go through without the token: ``GET``/``HEAD`` of exactly ``/health``, decoded
    and raw (so no encoding, dot segment, doubled or trailing slash, case or suffix reaches another route)."""
    if scope["type"] != "http" or scope.get("method") not in OPEN_METHODS or scope.get("path") != OPEN_PATH:
        return False
    raw = scope.get("raw_path")
    return raw is None or raw.partition(b"?")[0] == OPEN_PATH.encode()


class TokenGate:
    """ASGI middleware: every request but ``GET /health`` presents ``$SLIPSTREAM_SERVER_TOKEN`` (module
    docstring). Without a token it serves only connections from loopback.

    vLLM builds it as ``TokenGate(app)`` (Starlette's ``add_middleware``, on the first ASGI call), so the token
    is read from the environment then; ``token=`` sets it instead (tests).
    """

    required: ClassVar[bool] = False  # TokenRequired: no token refuses start-up instead

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        self.token = env_token() if token is None else token

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            if self.required and not self.token:
                await _refuse_startup(receive, send)
                return
        elif kind in ("http", "websocket") and not is_open(scope):
            refusal = self.refusal(scope)
            if refusal is not None:
                await _deny(scope, send, *refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request may not go through; None when it may."""
        path = scope.get("path", "")
        if not self.token:
            if self.required:
                return 401, f"{path}: this server has no token (${TOKEN_ENV}) and serves nothing without one"
            client = scope.get("client")
            if client and not is_loopback(client[0]):
                return 403, f"{path}: this server has no token (${TOKEN_ENV}) and serves this machine only"
            return None
        header = _header(scope, b"authorization")
        if token_matches(header, self.token):
            return None
        if not header.lower().startswith("bearer "):
            return 401, f"{path} needs `Authorization: Bearer <token>` (the server's token)"
        return 403, f"{path}: the token does not match this server's"


class TokenRequired(TokenGate):
    """:class:`TokenGate` for a server bound beyond loopback: without a token it does not start."""

    required: ClassVar[bool] = True


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


async def _refuse_startup(receive: Callable, send: Callable) -> None:
    message = await receive()
    if message["type"] == "lifespan.startup":
        await send(
            {
                "type": "lifespan.startup.failed",
                "message": (
                    f"this vLLM server binds beyond loopback and ${TOKEN_ENV} is not set: refusing to start "
                    "with its pause, abort and weight-update routes open. Set the token (Slipstream's "
                    "clients send it as `Authorization: Bearer <token>`) or bind 127.0.0.1"
                ),
            }
        )


async def _deny(scope: Scope, send: Callable, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # policy violation, before any accept
        return
    kind = "authentication_error" if status == 401 else "permission_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
