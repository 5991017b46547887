"""The one place that pauses, resumes and aborts generation on a server.

Both roles that control a server go through a :class:`ServerControl`: the weight-sync adapters
(pause around a version, resume after it or after a failed push) and the rollouter's clients (abort a
request or all of them; pause/resume for operators and tests). Each passes its own ``send``, so
requests keep the owner's HTTP client (connection pool, ``Authorization`` header with
``$SLIPSTREAM_SERVER_TOKEN``'s value) and its errors (``ServerError`` in the rollouter,
``TransferError`` in weight sync); what the requests look like comes from the server's
:class:`~slipstream.serverapi.spec.ServerAPI` only.

Example::

    control = ServerControl(VLLM, send)      # serverapi.VLLM, the description
    mode = await control.pause("in_place")   # POST /pause?mode=keep; mode.keeps_requests is True
    ...
    await control.resume()                   # POST /resume; control.paused is None again
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from slipstream.serverapi.spec import Call, PauseMode, ServerAPI

Send = Callable[[Call], Awaitable[Any]]


class ServerControl:
    """Pause, resume and abort on one server (see the module docstring).

    ``paused`` is the mode of the last pause this control sent and did not resume (None otherwise): a
    failed push resumes only what its own pause stopped. A failed resume leaves it set. ``paused_s`` adds up
    the time from each pause to its resume (the server generated nothing then), for the push metrics.
    """

    def __init__(self, api: ServerAPI, send: Send) -> None:
        self.api = api
        self._send_call = send
        self.paused: str | None = None
        self.paused_s = 0.0
        self._paused_at: float | None = None

    async def pause(self, mode: str) -> PauseMode:
        """Pause generation in ``mode`` (our name); ``ValueError`` for a mode the server lacks."""
        call = self.api.pause_call(mode)  # refuses an unknown mode before anything is sent
        started = time.monotonic()
        await self._send(call)
        self.paused = mode
        if self._paused_at is None:
            self._paused_at = started
        return self.api.pause_mode(mode)

    async def resume(self) -> None:
        await self._send(self.api.resume_call())
        self.paused = None
        if self._paused_at is not None:
            self.paused_s += time.monotonic() - self._paused_at
            self._paused_at = None

    async def abort(self, rid: str, route: str | None = None) -> None:
        """Stop request ``rid`` sent on generate route ``route``; its generate returns the partial output."""
        await self._send(self.api.abort_call(rid, route))

    async def abort_all(self) -> None:
        await self._send(self.api.abort_all_call())

    async def _send(self, call: Call) -> Any:
        """Every call here is repeatable: a second pause, resume or abort changes nothing."""
        return await self._send_call(dataclasses.replace(call, repeatable=True))
