"""HTTP helpers shared by the embedded server's native routes (``app.py``) and its OpenAI routes
(``openai_api.py``): JSON and SSE bodies, bounded body reads, tokenising off the event loop, aborting a request
whose client went away. Their own module so that ``app.py`` (which mounts the OpenAI router) and
``openai_api.py`` (which uses these) do not import each other.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import Request
from fastapi.responses import Response

from slipstream.rollouter.embedded.engine import EmbeddedEngine, RequestError, RequestState


def json_response(payload: object, status_code: int = 200) -> Response:
    return Response(
        content=msgspec.json.encode(payload), status_code=status_code, media_type="application/json"
    )


def error_response(message: str, status_code: int, err_type: str = "invalid_request_error") -> Response:
    return json_response({"error": {"message": message, "type": err_type, "code": status_code}}, status_code)


class BodyTooLarge(Exception):
    """A request body over ``max_request_bytes`` (HTTP 413)."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused past ``max_bytes``: by its Content-Length first, else counted as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the request body has {declared} bytes; this server accepts at most {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the request body exceeds {max_bytes} bytes, the most this server accepts")
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_body(request: Request, body_type: type, max_bytes: int):
    """Decode the JSON body into ``body_type``; an empty body means all defaults."""
    raw = await read_body(request, max_bytes)
    return msgspec.json.decode(raw or b"{}", type=body_type)


async def encode_text(engine: EmbeddedEngine, text: str) -> list[int]:
    """Tokenise in a worker thread: megabytes of text take seconds, which would stall every other request."""
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer: send token ids instead of text")
    return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens=False)


def sse(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def wait_or_abort_on_disconnect(engine: EmbeddedEngine, state: RequestState, request: Request) -> None:
    """Wait for ``state`` to finish; if the client goes away first, abort it (as SGLang does)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    waiter = asyncio.ensure_future(engine.wait(state))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not waiter.done():
            engine.abort(state.rid, "client disconnected")
            await waiter


__all__ = [
    "SSE_DONE",
    "BodyTooLarge",
    "decode_body",
    "encode_text",
    "error_response",
    "json_response",
    "read_body",
    "sse",
    "wait_or_abort_on_disconnect",
]
