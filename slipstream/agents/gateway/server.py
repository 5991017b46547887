"""The gateway: an OpenAI-compatible endpoint per episode, in front of the rollouter's inference client.

Users' own agent harnesses speak the OpenAI API; the gateway lets them drive the policy while the run records
exactly what the model saw and sampled. Each episode gets a session: a base URL
``http://127.0.0.1:PORT/s/<session>/v1`` and an API key (both random, the key checked in constant time; a
request to ``/v1/...`` with the key as bearer token finds its session too). Per request the gateway renders
the chat template itself with the served model's tokenizer, generates through the token-in/token-out
:class:`~slipstream.agents.protocol.InferenceClient` (so every backend works, and the rollouter's partial-
rollout wrapper resumes requests aborted by a weight push without the harness noticing), and records the
prompt ids it sent and the ids, logprobs and versions the server returned, never re-tokenised from text
(session.py assembles them into segments).

Routes (under ``/s/<session>`` or bare, with the key): ``POST /v1/chat/completions`` (``tools``, replies
with OpenAI ``tool_calls``, ``tool_choice`` none / auto / required / a named function, see render.py;
``stream`` sends the text as the server makes the tokens, through :data:`TOKEN_SINK`, where the client
can stream, and at the end otherwise; with ``n`` > 1 or ``stop`` strings the chunks follow the whole turn),
``POST /v1/completions`` (a text or token-id prompt), ``GET /v1/models``; and ``GET /health``.
``return_token_ids: true`` (vLLM's extension) adds ``token_ids`` and ``prompt_token_ids`` to a choice;
``logprobs`` gives the sampled token's log-probability.

Sampling is the run's (``rollout.sampling``): the behaviour policy of training data should not depend on
what a harness asks for. ``max_tokens`` caps a reply further; each reply is also capped to what is left of
``agent.max_total_tokens`` for the segment, and a session answers at most ``agent.max_turns`` requests with
generation (then, like a spent token budget, an empty reply with ``finish_reason: length``). ``stop``
strings end a reply at the first of them: the text returned leaves it out (as OpenAI does), the record keeps
the tokens up to the one that completed it (the model's own), and drops what was sampled after it (the
server generates on until its own stop, as the token-in/token-out interface has no stop strings). ``n`` > 1
samples n replies from the same prompt concurrently; only the one the harness continues in its next request
is recorded (and trained), the others never are (session.py says how "continues" is decided, and what an
episode ending with replies pending records). Bad requests get OpenAI-style errors (``{"error": {"message",
"type", "code"}}``) and cost nothing but themselves (checks.py: the body's size, depth and text are bounded
before anything is rendered). The gateway binds loopback unless told otherwise.

Images: a chat message's content may hold ``image_url`` parts with ``data:`` URLs (PNG, JPEG, WebP; any other
URL is refused, the gateway fetches nothing), decoded and checked in a worker thread (images.py, 400 naming
the message and part). The template renders one image pad per image, the segment's images go with every
request (vLLM's native route, as the rollouter sends a dataset's), and the record keeps the prompt as the
server expanded the pads, the ids the trainer scores with the segment's images
(``AgentLoopOutput.images``). New messages with images start a new segment (a trained sequence's images
sit in its prompt). Where the servers take no images (``image_refusal``: the embedded server, SGLang,
vLLM's /v1/completions) or the model has no image pad, a request with image parts is a 400 saying so.

The event loop serves every session of the rollouter, so nothing proportional to a request's size runs on
it: the body is parsed and measured, and the chat rendered and tokenised, in worker threads, as the
embedded server does.

Worked example::

    gw = Gateway(client, tokenizer, sampling=SamplingParams(max_new_tokens=256))
    await gw.start()
    s = gw.open_session("e0-p3-0")
    # OPENAI_BASE_URL=s.base_url OPENAI_API_KEY=s.api_key python my_harness.py
    episode = await gw.close_session(s)
    episode.segments[-1].response_ids, episode.segments[-1].loss_mask
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from slipstream.agents.base import request_params
from slipstream.agents.gateway.checks import (
    MAX_REQUEST_BYTES,
    GatewayError,
    check_chat,
    check_common,
    check_completion,
    check_text_size,
    parse_body,
)
from slipstream.agents.gateway.images import IMAGE_PAD, chat_images, image_parts
from slipstream.agents.gateway.render import GatewayRenderer, cut_at_stop, parse_reply, tool_prefill
from slipstream.agents.gateway.session import Choice, Session, record
from slipstream.agents.multimodal import ImageLimits, ImageTokens
from slipstream.agents.protocol import TOKEN_SINK, GenerateOutput, InferenceClient, SamplingParams
from slipstream.utils.logging import get_logger
from slipstream.utils.net import LOOPBACK, is_loopback
from slipstream.utils.text_bounds import longest_token_chars

log = get_logger(__name__)

# Seconds close_session waits for a request of the session to notice its abort.
CLOSE_WAIT_S = 30.0


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def _error(err: GatewayError) -> Response:
    return _json({"error": {"message": err.message, "type": err.err_type, "code": err.status}}, err.status)


def _key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class _Server:
    """uvicorn inside the caller's event loop, without taking over the process's signal handlers."""

    def __init__(self, app: Starlette, sock: socket.socket) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.server = Quiet(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.sock = sock
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="gateway http")
        while not self.server.started:  # start-up is a few event-loop turns
            if self.task.done():
                self.task.result()
                raise RuntimeError("the gateway's HTTP server stopped during start-up")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close()


class Gateway:
    """OpenAI-compatible sessions over an :class:`InferenceClient` (see the module docstring).

    Lifecycle: construct, ``await start()`` on the event loop that owns ``client``, then per episode
    :meth:`open_session` / :meth:`close_session`; ``await stop()`` at the end.
    """

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        *,
        sampling: SamplingParams | None = None,
        max_total_tokens: int = 4096,
        max_turns: int = 1000,
        host: str = LOOPBACK,
        port: int = 0,
        model_name: str = "slipstream-policy",
        image_refusal: str | None = None,
        image_limits: ImageLimits | None = None,
    ) -> None:
        """``image_refusal``: why the servers behind ``client`` take no images (a request with image parts is
        answered 400 with it), None where they do; ``image_limits`` bounds a request's images (the
        dataset's defaults when None)."""
        if not is_loopback(host):
            log.warning("the gateway binds %s: session keys are its only protection beyond this host", host)
        self.client = client
        self.tokenizer = tokenizer
        self.renderer = GatewayRenderer(tokenizer)
        self.vocab_size = len(tokenizer)
        self.longest_token = longest_token_chars(tokenizer)
        self.sampling = sampling or SamplingParams()
        self.max_total_tokens = max_total_tokens
        self.max_turns = max_turns
        self.host, self.port = host, port
        self.model_name = model_name
        self.image_refusal = image_refusal
        self.image_limits = image_limits or ImageLimits()
        self.image_pad: int | None = tokenizer.get_vocab().get(IMAGE_PAD)
        self._image_tokens: ImageTokens | None = None  # read from the model's files at the first image
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[bytes, str] = {}
        self._server: _Server | None = None
        self.latest_version = 0
        self.counters = {"requests": 0, "errors": 0, "divergences": 0, "resumes": 0, "sessions": 0}

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        self._server = _Server(self._app(), sock)
        await self._server.start()

    async def stop(self) -> None:
        for session in list(self._sessions.values()):
            await self.close_session(session)
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def open_session(self, uid: str) -> Session:
        """A new session for episode ``uid``: ``base_url`` and ``api_key`` go to the harness."""
        sid = secrets.token_urlsafe(12)
        session = Session(uid, secrets.token_urlsafe(32))
        session.sid = sid
        session.base_url = f"{self.url}/s/{sid}/v1"
        self._sessions[sid] = session
        self._by_key[_key_hash(session.api_key)] = sid
        self.counters["sessions"] += 1
        return session

    async def close_session(self, session: Session) -> Session:
        """End a session: later requests get 404 and a request still generating is aborted (its harness
        gets an error). Returns the session with its segments and counters."""
        session.closed = True
        self._sessions.pop(session.sid, None)
        self._by_key.pop(_key_hash(session.api_key), None)
        for rid in list(session.active_rids):
            with contextlib.suppress(Exception):
                await self.client.abort(rid)
        with contextlib.suppress(TimeoutError):  # the aborted request records nothing more once held
            async with asyncio.timeout(CLOSE_WAIT_S):
                async with session.lock:
                    session.settle()
                    session.drop_unsent()
        return session

    # ------------------------------------------------------------------ HTTP
    def _app(self) -> Starlette:
        routes = []
        for prefix in ("/s/{sid}/v1", "/v1"):
            routes += [
                Route(f"{prefix}/chat/completions", self._chat, methods=["POST"]),
                Route(f"{prefix}/completions", self._completions, methods=["POST"]),
                Route(f"{prefix}/models", self._models, methods=["GET"]),
            ]
        routes.append(Route("/health", lambda request: _json({"status": "ok"}), methods=["GET"]))
        return Starlette(routes=routes)

    def _session(self, request: Request) -> Session:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        sid = request.path_params.get("sid")
        if sid is None:
            sid = self._by_key.get(_key_hash(key), "") if key else ""
        session = self._sessions.get(sid) if sid else None
        if session is None:
            raise GatewayError(404, "no such session (it ended, or the URL or API key is wrong)", "not_found")
        if not hmac.compare_digest(key.encode(), session.api_key.encode()):
            raise GatewayError(401, "the API key does not belong to this session", "authentication_error")
        return session

    async def _body(self, request: Request) -> dict[str, Any]:
        """The body, refused past MAX_REQUEST_BYTES as it arrives, too deep, or with more text than an
        episode's tokens can hold (checks.py); parsed in a worker thread."""
        too_large = GatewayError(413, f"the request body exceeds {MAX_REQUEST_BYTES} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_REQUEST_BYTES:
                raise too_large
            chunks.append(chunk)
        body, chars = await asyncio.to_thread(parse_body, b"".join(chunks))
        check_text_size(chars, self.max_total_tokens, self.longest_token)
        return body

    async def _models(self, request: Request) -> Response:
        try:
            self._session(request)
        except GatewayError as err:
            return _error(err)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slipstream"}
        return _json({"object": "list", "data": [card]})

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        session: Session | None = None
        try:
            session = self._session(request)
            body = await self._body(request)
            check_common(body)
            if chat:
                check_chat(body)
            else:
                check_completion(body, self.vocab_size)
            session.requests += 1
            self.counters["requests"] += 1
            if body.get("stream") and (body.get("n") or 1) == 1 and not _stops(body):
                stream = self._stream_turn(session, body, chat)
                return StreamingResponse(stream, media_type="text/event-stream")
            result = await self._turn(session, body, chat)
        except GatewayError as err:
            if session is not None:
                session.errors += 1
            self.counters["errors"] += 1
            return _error(err)
        except Exception as err:  # a bug here must cost one request, not the rollouter
            log.exception("gateway request failed")
            if session is not None:
                session.errors += 1
            self.counters["errors"] += 1
            return _error(GatewayError(500, f"internal error: {type(err).__name__}: {err}", "server_error"))
        return self._respond(body, result, chat)

    # ------------------------------------------------------------------ one turn
    async def _turn(self, session: Session, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        async with session.lock:  # one request of an episode at a time: a segment is linear
            if session.closed:
                raise GatewayError(404, "the session has ended", "not_found")
            state = session.checkpoint()
            divergences = session.divergences
            try:
                prompt_ids, tools = await self._prompt(session, body, chat)
                prefill = self._prefill(body) if chat and tools else []
                outs = await self._generate(session, prompt_ids + prefill, body)
                if outs and session.current.images:
                    prompt_ids = self._expand(session, outs[0], prompt_ids, prefill)
            except BaseException:
                session.rollback(state)
                raise
            self.counters["divergences"] += session.divergences - divergences
            stops = _stops(body)
            choices = [self._choice(o, prefill, body, chat, bool(tools), stops) for o in outs]
            self._record(session, body, chat, choices)
            if not choices:  # no budget or turns left: an empty reply (nothing recorded)
                empty = GenerateOutput(output_ids=[], logprobs=[], versions=[], finish_reason="length")
                choices = [self._choice(empty, [], body, chat, False, stops)]
                choices[0].finish = "length"
                if chat:
                    session.replied_chat(choices[0].reply, False)
            session.final_text = (choices[0].reply.get("content") if chat else choices[0].reply["text"]) or ""
            return {"choices": choices, "prompt_ids": prompt_ids}

    # ------------------------------------------------------------------ a streamed turn
    async def _stream_turn(self, session: Session, body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        """The turn as SSE, its text sent as the server makes the tokens (:data:`TOKEN_SINK`; a client that
        cannot stream gives them at the end). An abort at a weight push is resumed below and its pieces
        arrive in order, so the harness sees one reply. Text that may open a tool call is held back until the
        turn ends, when its parsed ``tool_calls`` follow. An error after the headers went out is an SSE
        ``error`` event (what OpenAI clients raise from)."""
        envelope = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
                    "object": _chunk_kind(chat), "created": int(time.time()), "model": self.model_name}  # fmt: skip
        pieces: asyncio.Queue[list[int]] = asyncio.Queue()
        context = contextvars.copy_context()
        context.run(TOKEN_SINK.set, pieces.put_nowait)
        task = asyncio.create_task(self._turn(session, body, chat), context=context)
        hold = chat and bool(body.get("tools")) and body.get("tool_choice") != "none"
        ids: list[int] = []
        sent = ""
        try:
            if chat:
                yield _sse({**envelope, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None}]})  # fmt: skip
            while not task.done() or not pieces.empty():
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                ids += getter.result()
                text = self._visible(ids, hold)
                if len(text) > len(sent) and text.startswith(sent):
                    yield _sse({**envelope, "choices": [_delta(chat, text[len(sent) :])]})
                    sent = text
            result = task.result()
        except GatewayError as err:
            session.errors += 1
            self.counters["errors"] += 1
            yield _sse({"error": {"message": err.message, "type": err.err_type, "code": err.status}})
            return
        except Exception as err:  # noqa: BLE001 - a bug here must cost one request, not the rollouter
            log.exception("gateway request failed")
            session.errors += 1
            self.counters["errors"] += 1
            yield _sse({"error": {"message": f"internal error: {type(err).__name__}: {err}", "type": "server_error",
                                  "code": 500}})  # fmt: skip
            return
        finally:
            if not task.done():  # the harness went away: the turn is cancelled and records nothing
                task.cancel()
        for chunk in self._stream_end(body, result, envelope, chat, sent):
            yield chunk

    def _visible(self, ids: list[int], hold: bool) -> str:
        """The text of ``ids`` safe to send now: all of it, or with ``hold``, what comes before the first
        ``<`` (a tool call may be opening there)."""
        stop_ids = self.renderer.stop_ids
        ids = ids[:-1] if ids and ids[-1] in stop_ids else ids
        if hold:
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            if "<" in raw:
                keep = cut_at_stop(self.tokenizer, ids, ["<"]) - 1  # tokens before the one bringing it
                ids = ids[: max(0, keep)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_end(
        self, body: dict[str, Any], result: dict[str, Any], envelope: dict, chat: bool, sent: str
    ):
        """The chunks after the streamed text: what the parsed reply adds, logprobs and token ids, tool calls,
        the finish reason, usage when asked, ``[DONE]``."""
        (c,) = result["choices"]
        choice = self._choice_body(body, result, c, 0, chat)
        final = (c.reply.get("content") if chat else c.reply["text"]) or ""
        rest = final[len(sent) :] if final.startswith(sent) else ""
        extra = {k: choice[k] for k in ("token_ids", "prompt_token_ids", "weight_versions") if k in choice}
        last = {**_delta(chat, rest), "logprobs": choice["logprobs"], **extra}
        chunks = [_sse({**envelope, "choices": [last]})]
        calls = [
            {**call, "index": i} for i, call in enumerate((c.reply.get("tool_calls") or []) if chat else [])
        ]
        if calls:
            chunks.append(_sse({**envelope, "choices": [{"index": 0, "delta": {"tool_calls": calls},
                                                         "finish_reason": None}]}))  # fmt: skip
        done = _delta(chat, "")
        done["finish_reason"] = c.finish
        chunks.append(_sse({**envelope, "choices": [done]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            n = len(c.prefill) + len(c.out.output_ids)
            p = len(result["prompt_ids"])
            usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
            chunks.append(_sse({**envelope, "choices": [], "usage": usage}))
        chunks.append(b"data: [DONE]\n\n")
        return chunks

    def _prefill(self, body: dict[str, Any]) -> list[int]:
        text = tool_prefill(body.get("tool_choice"))
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _choice(self, out: GenerateOutput, prefill: list[int], body: dict[str, Any], chat: bool,
                with_tools: bool, stops: list[str]) -> Choice:  # fmt: skip
        """One sampled reply, cut at a ``stop`` string, parsed (tool calls unless ``tool_choice`` is none)."""
        keep = cut_at_stop(self.tokenizer, out.output_ids, stops)
        stopped = bool(stops) and _has_stop(self.tokenizer, out.output_ids[:keep], stops)
        if keep < len(out.output_ids):
            out = msgspec.structs.replace(out, output_ids=out.output_ids[:keep], logprobs=out.logprobs[:keep],
                                          versions=out.versions[:keep], finish_reason="stop")  # fmt: skip
        stop_ids = self.renderer.stop_ids
        ended = bool(out.output_ids) and out.output_ids[-1] in stop_ids
        if chat:
            parse = with_tools and body.get("tool_choice") != "none"
            reply = parse_reply(self.tokenizer, out.output_ids, stop_ids, parse, prefill=prefill, stops=stops)
        else:
            text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            reply = {"text": text[: min(text.find(x) for x in stops if x in text)] if stopped else text}
        choice = Choice(prefill, out, reply, ended)
        choice.finish = "stop" if out.finish_reason == "stop" or stopped else "length"
        if chat and reply.get("tool_calls"):
            choice.finish = "tool_calls"
        return choice

    def _record(self, session: Session, body: dict[str, Any], chat: bool, choices: list[Choice]) -> None:
        """Record the reply; the n replies of an n > 1 request wait for the next request to show which one
        the harness used, and only that one is recorded (Session.offer_choices)."""
        for c in choices:
            session.resumes += c.out.num_resumes
            self.counters["resumes"] += c.out.num_resumes
            if c.out.versions:
                self.latest_version = max(self.latest_version, c.out.versions[-1])
        if not choices:
            return
        if len(choices) > 1:
            session.offer_choices(choices, prompt_was_text=not chat and isinstance(body["prompt"], str))
            return
        first = choices[0]
        record(session.current, first.prefill, first.out)
        if chat:
            session.replied_chat(first.reply, first.ended)
        else:
            session.replied_completion(first.reply["text"], isinstance(body["prompt"], str))

    async def _prompt(self, session: Session, body: dict[str, Any], chat: bool):
        """The prompt ids of a request, rendered and tokenised in a worker thread (checks.py bounded the
        text first): a long chat takes seconds of CPU, which on the event loop would stall every session."""
        tok = self.tokenizer
        if not chat:
            encode = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
            return await _in_thread(session.begin_completion, body["prompt"], encode), None
        messages, tools = body["messages"], body.get("tools") or None
        r = self.renderer
        if any(image_parts(m.get("content")) for m in messages):
            self._check_images_served()

        def begin() -> list[int]:
            images = chat_images(messages, self.image_limits)
            key = json.dumps(tools, sort_keys=True) if tools else ""
            delta = lambda new, ended: r.delta_ids(new, tools, key, ended)  # noqa: E731
            ids = session.begin_chat(messages, key, lambda m: r.full_ids(m, tools, key), delta, images)
            self._check_pads(ids, len(session.current.images))
            return ids

        try:
            ids = await _in_thread(begin)
        except GatewayError:
            raise
        except Exception as err:  # a template that cannot render these messages: the caller's input
            raise GatewayError(400, f"cannot render the messages with the chat template: {err}") from err
        return ids, tools

    # ------------------------------------------------------------------ images
    def _check_images_served(self) -> None:
        if self.image_refusal:
            raise GatewayError(400, f"this gateway takes no image parts: {self.image_refusal}")
        if self.image_pad is None:
            raise GatewayError(
                400,
                f"this gateway takes no image parts: the model's tokenizer has no {IMAGE_PAD} token, so it is "
                "not a vision-language model the gateway can send images to",
            )

    def _check_pads(self, ids: list[int], num_images: int) -> None:
        """Refuse a prompt whose image pads are not one per image: vLLM would fail it with a 500, or read
        an image into a pad the harness typed as text."""
        found = ids.count(self.image_pad) if self.image_pad is not None else 0
        if found != num_images:
            raise GatewayError(
                400,
                f"the prompt renders {found} image placeholders ({IMAGE_PAD}) for {num_images} images: the "
                "chat template renders no image parts, or the messages' text holds image placeholders",
            )

    def _expansion(self, session: Session) -> int:
        """Tokens the server adds to the current segment's prompt when it expands its image pads."""
        images = session.current.images if session.current is not None else []
        if not images:
            return 0
        if self._image_tokens is None:
            path = getattr(self.tokenizer, "name_or_path", "")
            self._image_tokens = (ImageTokens.from_model(path) if path else None) or ImageTokens()
        return sum(self._image_tokens.count(image) - 1 for image in images)

    def _expand(self, session: Session, out: GenerateOutput, prompt_ids: list[int], prefill: list[int]):
        """Record the prompt as the server expanded its image pads (what the trainer scores; Session.expand)
        and return it without the forced prefix: the prompt the server answered, as the harness sees it."""
        if not out.prompt_ids:
            raise GatewayError(502, "the server returned no expanded prompt for a request with images",
                               "server_error")  # fmt: skip
        try:
            session.expand(out.prompt_ids, prompt_ids + prefill)
        except ValueError as err:
            raise GatewayError(502, str(err), "server_error") from err
        return list(out.prompt_ids[: len(out.prompt_ids) - len(prefill)])

    async def _generate(self, session: Session, prompt_ids: list[int], body: dict[str, Any]):
        """``n`` replies (sampled concurrently from the same prompt), or none when no turn or token is left.
        A segment with images sends them with every request (the prompt holds one pad per image)."""
        if session.turns >= self.max_turns:
            return []
        used = len(prompt_ids) + self._expansion(session)
        # OpenAI's answer to a prompt over the context: the harness ends the episode there
        if used > self.max_total_tokens:
            raise GatewayError(
                400,
                f"the prompt holds {used} tokens, more than an episode's {self.max_total_tokens} "
                "(agent.max_total_tokens)",
                "context_length_exceeded",
            )
        budget = min(self.sampling.max_new_tokens, self.max_total_tokens - used)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            budget = min(budget, int(asked))
        if budget <= 0:
            return []
        params = request_params(self.sampling, budget, self.renderer.stop_ids)
        n = body.get("n") or 1
        rids = [f"{session.uid}-r{session.requests}-{secrets.token_hex(3)}" for _ in range(n)]
        session.active_rids = rids
        # images only where the segment has some, so text-only clients need not take the keyword
        media = {"images": session.current.images} if session.current.images else {}
        try:
            outs = await asyncio.gather(
                *(
                    self.client.generate(prompt_ids, params, rid=rid, session_id=session.uid, **media)
                    for rid in rids
                )  # fmt: skip
            )
        except Exception as err:  # noqa: BLE001 - the harness gets the reason; the run goes on
            raise GatewayError(
                503, f"generation failed: {type(err).__name__}: {err}", "server_error"
            ) from err
        finally:
            session.active_rids = []
        if any(out.finish_reason == "abort" for out in outs):
            session.aborted = True
            raise GatewayError(503, "the episode was stopped (the run is ending or the episode timed out)",
                               "server_error")  # fmt: skip
        return list(outs)

    # ------------------------------------------------------------------ responses
    def _respond(self, body: dict[str, Any], result: dict[str, Any], chat: bool) -> Response:
        choices: list[Choice] = result["choices"]
        prompt_len = len(result["prompt_ids"])
        generated = sum(len(c.prefill) + len(c.out.output_ids) for c in choices)
        usage = {
            "prompt_tokens": prompt_len,
            "completion_tokens": generated,
            "total_tokens": prompt_len + generated,
        }
        out_choices = [self._choice_body(body, result, c, j, chat) for j, c in enumerate(choices)]
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        kind = "chat.completion" if chat else "text_completion"
        envelope = {"id": rid, "object": kind, "created": created, "model": self.model_name}
        if not body.get("stream"):
            return _json({**envelope, "choices": out_choices, "usage": usage})
        chunks = [b for c in out_choices for b in _stream_chunks(envelope, c, chat)]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(_sse({**envelope, "object": _chunk_kind(chat), "choices": [], "usage": usage}))
        chunks.append(b"data: [DONE]\n\n")
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    def _choice_body(self, body: dict[str, Any], result: dict[str, Any], c: Choice, index: int, chat: bool):
        out = c.out
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish}
        if chat:
            choice["message"] = c.reply
            choice["logprobs"] = self._chat_logprobs(out) if body.get("logprobs") else None
        else:
            choice["text"] = c.reply["text"]
            choice["logprobs"] = self._completion_logprobs(out) if body.get("logprobs") is not None else None
        if body.get("return_token_ids"):
            choice["token_ids"] = list(c.prefill) + list(out.output_ids)
            choice["prompt_token_ids"] = list(result["prompt_ids"])
            choice["weight_versions"] = [out.versions[0] if out.versions else 0] * len(c.prefill) + list(
                out.versions
            )
        return choice

    def _chat_logprobs(self, out: GenerateOutput) -> dict:
        content = []
        for t, lp in zip(out.output_ids, out.logprobs, strict=True):
            text = self.tokenizer.decode([t])
            entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
            content.append({**entry, "top_logprobs": [entry]})
        return {"content": content}

    def _completion_logprobs(self, out: GenerateOutput) -> dict:
        tokens = [self.tokenizer.decode([t]) for t in out.output_ids]
        offsets, pos = [], 0
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        top = [{t: lp} for t, lp in zip(tokens, out.logprobs, strict=True)]
        return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": top,
                "text_offset": offsets}  # fmt: skip


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread. A caller cancelled meanwhile (its harness went away) still waits
    for it to finish: ``fn`` changes the session, and the caller's rollback must see it done, not half-way."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        raise


def _sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _chunk_kind(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def _stream_chunks(envelope, choice, chat: bool) -> list[bytes]:
    """The SSE chunks of one finished choice: role and content, tool calls, finish."""
    env = {**envelope, "object": _chunk_kind(chat)}
    extra = {k: choice[k] for k in ("token_ids", "prompt_token_ids", "weight_versions") if k in choice}
    index = choice["index"]
    chunks = []
    if chat:
        message = choice["message"]
        first = {"index": index, "delta": {"role": "assistant", "content": message.get("content") or ""},
                 "logprobs": choice["logprobs"], "finish_reason": None, **extra}  # fmt: skip
        chunks.append(_sse({**env, "choices": [first]}))
        calls = [{**c, "index": i} for i, c in enumerate(message.get("tool_calls") or [])]
        if calls:
            chunks.append(_sse({**env, "choices": [{"index": index, "delta": {"tool_calls": calls},
                                                    "finish_reason": None}]}))  # fmt: skip
        last = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}
    else:
        first = {"index": index, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None,
                 **extra}  # fmt: skip
        chunks.append(_sse({**env, "choices": [first]}))
        last = {"index": index, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    chunks.append(_sse({**env, "choices": [last]}))
    return chunks


def _delta(chat: bool, text: str) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def _has_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> bool:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return any(s in text for s in stops)
