"""HTTP helpers shared by the embedded server's native routes (``app.py``) and its OpenAI routes
(``openai_api.py``): JSON and SSE bodies, bounded body reads, tokenising off the event loop, aborting a request
whose client went away. Their own module so that ``app.py`` (which mounts the OpenAI router) and
``openai_api.py`` (which uses these) do not import each other.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from slipstream.rollouter.embedded.engine import EmbeddedEngine, RequestError, RequestState
from slipstream.utils.text_bounds import longest_token_chars


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
    try:
        return msgspec.json.decode(raw or b"{}", type=body_type)
    except RecursionError:  # msgspec recurses per level: a hostile 10,000-deep body must be a 400, not a 500
        raise RequestError("the request body nests too deeply to decode") from None


# A prompt longer than this many characters per allowed token has its head tokenised first (see encode_bounded).
HEAD_CHARS_PER_TOKEN = 8
# Tokens the head may exceed the limit by before the prompt is refused: cutting the text can split a word.
HEAD_MARGIN_TOKENS = 16


def encode_bounded(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """``text``'s token ids, or RequestError when it has more than ``max_tokens``, with work bounded by the
    limit rather than by the text: a hostile 4 MiB prompt took 8.5 CPU-seconds to tokenise in full, only to be
    refused by the length check after (and six at once quadrupled every other request's latency).

    1. characters first: a text longer than ``max_tokens`` times the longest token certainly has more tokens
       (each token covers at most that many characters), refused without tokenising;
    2. then tokens: a text longer than ``HEAD_CHARS_PER_TOKEN`` characters per allowed token has its head (cut
       at a space) tokenised first, and is refused when the head alone is over the limit (by a margin for the
       cut word); only a text that passes both is tokenised whole.
    """
    refuse = f"the prompt has more than {max_tokens} tokens, the most this server accepts"
    if len(text) > max_tokens * longest_token_chars(tokenizer):
        raise RequestError(f"{refuse} ({len(text)} characters)")
    head = max_tokens * HEAD_CHARS_PER_TOKEN
    if len(text) > head:
        cut = text.rfind(" ", head // 2, head)
        ids = tokenizer.encode(text[: cut if cut > 0 else head], add_special_tokens=False)
        if len(ids) > max_tokens + HEAD_MARGIN_TOKENS:
            raise RequestError(f"{refuse} ({len(text)} characters)")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_tokens:
        raise RequestError(f"the prompt has {len(ids)} tokens; this server accepts at most {max_tokens}")
    return ids


def max_prompt_tokens(engine: EmbeddedEngine) -> int:
    return engine.cfg.max_model_len - 1  # max_model_len includes at least one response token


async def encode_text(engine: EmbeddedEngine, text: str) -> list[int]:
    """Tokenise in a worker thread (megabytes of text take seconds, which would stall every other request),
    bounded by the server's prompt limit (:func:`encode_bounded`)."""
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer: send token ids instead of text")
    return await asyncio.to_thread(encode_bounded, engine.tokenizer, text, max_prompt_tokens(engine))


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
    "encode_bounded",
    "encode_text",
    "max_prompt_tokens",
    "error_response",
    "json_response",
    "longest_token_chars",
    "read_body",
    "sse",
    "wait_or_abort_on_disconnect",
]
