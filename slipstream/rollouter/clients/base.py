"""One inference client interface over every server we drive (embedded, SGLang, vLLM).

A :class:`ServerClient` satisfies :class:`slipstream.agents.protocol.InferenceClient` (``generate`` and
``abort``) and adds abort-all, pause/resume in the modes of design.md §3, health and the weight version.
Each client keeps one long-lived :class:`~slipstream.utils.http_client.HTTPClient` (aiohttp; keep-alive
connections, never a connection per request, and about a quarter of httpx's CPU per call, which at hundreds
of servers is much of the rollouter's loop); use it inside one event loop and ``await aclose()`` at the end.

What the server's API looks like (paths, pause modes, how an abort names a request) comes from its
:class:`~slipstream.serverapi.ServerAPI` (``server_api``); abort, pause and resume are sent by the
client's :class:`~slipstream.serverapi.ServerControl` (``control``), the same object weight sync uses,
over this client's HTTP connection. Subclasses write only the generate route and the info reads.

Errors: :class:`ServerUnavailable` when the server cannot be reached, the connection breaks or it answers
503 (the load balancer then moves the request to another replica), :class:`ServerError` when it answered
with another error status (the message is the server's own).

Control calls (abort, pause, resume) need the server's token when it has one (``$SLIPSTREAM_SERVER_TOKEN``
on the server): :meth:`ServerClient.authorize` makes a client send it as ``Authorization: Bearer`` on every
request; the rollouter's balancer does this with the run's token.

Pause modes are ours (``abort``, ``in_place``, ``retract``, ``wait``); a mode the server lacks raises
``ValueError`` before anything is sent.
"""

from __future__ import annotations

import base64
import io
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.serverapi import Call, ServerAPI, ServerControl
from slipstream.utils.http_client import HTTPClient, HTTPClientError, Reply

if TYPE_CHECKING:
    from slipstream.rollouter.config import RolloutConfig


class ServerError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url = url
        self.status = status
        self.message = message


class ServerUnavailable(ServerError):
    """The server could not be reached, the connection broke mid-request, or it answered 503 (its engine is
    down, or, for vLLM, paused: :class:`VLLMClient` retries those itself). ``status`` is 0 or 503."""

    def __init__(self, url: str, message: str, status: int = 0) -> None:
        super().__init__(url, status, message)


def parse_version(value: Any) -> int:
    """A weight version from the wire (SGLang and vLLM send strings; ``"default"`` is version 0)."""
    if isinstance(value, bool):
        raise ValueError(f"not a weight version: {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text in ("", "default", "None"):
        return 0
    try:
        return int(text)
    except ValueError:
        return int(float(text))


def expand_spans(spans: list[dict] | None, n: int, fallback: int) -> list[int]:
    """Per-token versions from ``[{version, start, end}]`` spans (``end`` exclusive) over ``n`` tokens."""
    versions = [fallback] * n
    for span in spans or []:
        v = parse_version(span["version"])
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            versions[i] = v
    return versions


def encode_routed_experts(routes: np.ndarray) -> str:
    """Routes as vLLM's native route sends them: base64 of the array's ``.npy`` bytes (shape and dtype inside).

    One format for every kind, so :func:`decode_routed_experts` reads the embedded server and vLLM alike.
    """
    with io.BytesIO() as buffer:
        np.save(buffer, np.ascontiguousarray(routes), allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def decode_routed_experts(text: str) -> np.ndarray:
    """``[tokens - 1, layers, experts_per_token]`` expert ids from :func:`encode_routed_experts`'s string.

    Integer dtypes only (uint8 when every id fits; int16 with -1 where a forward never reached a row); never
    unpickles. Raises ``ValueError`` on anything else.
    """
    try:
        routes = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"routed_experts is not base64 .npy: {err}") from err
    if routes.ndim != 3 or routes.dtype.kind not in "iu":
        raise ValueError(
            f"routed_experts must be integer [tokens, layers, k], got {routes.dtype} {routes.shape}"
        )
    return routes


def error_message(response: Reply) -> str:
    """The server's own error text: ``error.message``, ``error``, ``detail`` or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000] or response.reason
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(body)[:2000]


class ServerClient(ABC):
    """Token-in/token-out client of one inference server (see the module docstring).

    Example::

        client = make_client(server_kind("sglang"), "http://127.0.0.1:30000")  # the kind: from above
        out = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=8), rid="r0")
        await client.pause("in_place"); ...; await client.resume()
        await client.aclose()
    """

    kind: ClassVar[str]
    default_api: ClassVar[ServerAPI]
    route: str | None = None  # the generate route requests go to (None: the description's default)

    def __init__(
        self,
        base_url: str,
        *,
        server_api: ServerAPI | None = None,
        timeout_s: float = 3600.0,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.server_api = server_api or self.default_api
        self.control = ServerControl(self.server_api, self._send)
        self._http = HTTPClient(
            self.base_url, timeout_s=timeout_s, connect_timeout_s=10.0, max_connections=max_connections
        )

    @classmethod
    def options_from(cls, cfg: RolloutConfig) -> dict:
        """Constructor options this kind reads from the rollout config (none by default)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def authorize(self, token: str) -> ServerClient:
        """Send ``token`` with every request from now on ("" sends none); returns this client."""
        self._http.set_token(token)
        return self

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        timeout: float | None = None,
        repeatable: bool = False,
    ) -> Reply:
        """Send one request; raise :class:`ServerUnavailable` / :class:`ServerError` on failure."""
        kwargs: dict[str, Any] = {"json": json, "params": params, "repeatable": repeatable}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self._http.request(method, path, **kwargs)
        except HTTPClientError as err:
            raise ServerUnavailable(self.base_url, f"{method} {path}: {err}") from err
        if response.status_code == 503:
            raise ServerUnavailable(self.base_url, error_message(response), status=503)
        if response.status_code >= 400:
            raise ServerError(self.base_url, response.status_code, error_message(response))
        return response

    async def _send(self, call: Call) -> Reply:
        """Send a request the server's description built (the control's transport)."""
        return await self._request(
            call.method,
            call.path,
            json=call.json,
            params=dict(call.params) or None,
            repeatable=call.repeatable,
        )

    @abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateOutput:
        """Generate a continuation with per-token logprobs and versions; ``server`` is this base URL."""

    async def abort(self, rid: str) -> None:
        """Stop request ``rid``; its pending generate returns the partial output (finish ``abort``)."""
        await self.control.abort(rid, self.route)

    async def abort_all(self) -> None:
        """Stop every request on the server."""
        await self.control.abort_all()

    async def pause(self, mode: str) -> None:
        """Pause generation (``abort``, ``in_place``, ...); new requests wait (or are retried) until resume."""
        await self.control.pause(mode)

    async def resume(self) -> None:
        """Resume after :meth:`pause`."""
        await self.control.resume()

    async def engine_counters(self) -> dict[str, float] | None:
        """The server's own cumulative counters under ``rollouter/server_stats.py``'s names (prompt and
        generated tokens, prefix-cache lookups and hits, time in prefill and decode), or None where its kind
        reports none."""
        return None

    @abstractmethod
    async def weight_version(self) -> int:
        """The weight version the server serves now."""

    @abstractmethod
    async def model_info(self) -> dict:
        """What the server says about its model (path, weight_version, limits)."""

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within 5 s."""
        try:
            response = await self._http.get(self.server_api.health.path, timeout=5.0)
        except HTTPClientError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()
