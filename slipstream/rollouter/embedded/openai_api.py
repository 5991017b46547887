"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` on the embedded engine.

For tools and people that speak OpenAI (the official ``openai`` client, evaluation harnesses). The RL path
uses ``/generate``; these routes run the same engine and add vLLM's ``return_token_ids`` extension and, as
SGLang does, the weight versions (``metadata.weight_version``/``weight_versions``, and per choice).

Log-probabilities: the engine computes the sampled token's log-probability only, so ``logprobs`` (completions)
may be 0 or 1 and ``top_logprobs`` (chat) 0 or 1; larger values get a 400 rather than a shorter list.
Stop strings are not supported (use ``stop_token_ids``); streaming supports ``n == 1``.

Request hygiene, as vLLM does it: ``n`` is capped (``max_n``); ``max_tokens`` (and chat's
``max_completion_tokens``) must be at least 1, absent meaning "up to the context length" in chat; chat
messages need a known role and content (an assistant message with ``tool_calls`` may omit content), and a
400 names the message index and field; a chat template sent with the request is Jinja run by the server,
so it is refused unless the server was started with ``trust_request_chat_template``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.config import EmbeddedServerConfig
from slipstream.rollouter.embedded.engine import EmbeddedEngine, RequestError, RequestState
from slipstream.rollouter.embedded.http import (
    SSE_DONE,
    decode_body,
    encode_bounded,
    encode_text,
    json_response,
    max_prompt_tokens,
    sse,
    wait_or_abort_on_disconnect,
)
from slipstream.rollouter.embedded.schemas import ChatCompletionRequest, CompletionRequest, _OpenAISampling

# OpenAI's message roles ("function" is deprecated there and not rendered by chat templates).
ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_common(req: _OpenAISampling, cfg: EmbeddedServerConfig) -> None:
    if req.stop:
        raise RequestError("stop strings are not supported by this server; use stop_token_ids")
    if req.seed is not None:
        raise RequestError("seed is not supported per request; the server's sampling seed is set at start-up")
    if req.presence_penalty or req.frequency_penalty:
        raise RequestError("presence_penalty and frequency_penalty are not supported (must be 0)")
    if not 1 <= req.n <= cfg.max_n:
        raise RequestError(f"n must be between 1 and {cfg.max_n} (this server's max_n), got {req.n}")
    if req.stream and req.n != 1:
        raise RequestError("streaming supports n == 1 only")


def _sampling(req: _OpenAISampling, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop_token_ids=req.stop_token_ids,
    )


async def _submit_n(engine: EmbeddedEngine, req: _OpenAISampling, ids: list[int], sampling: SamplingParams):
    base = req.request_id or uuid.uuid4().hex
    rids = [base] if req.n == 1 else [f"{base}-{i}" for i in range(req.n)]
    states = []
    try:
        for rid in rids:
            states.append(await engine.submit(ids, sampling, rid=rid, ignore_eos=req.ignore_eos))
    except BaseException:
        for state in states:
            engine.abort(state.rid, "a sibling sample of this request was rejected")
        raise
    return base, states


def _finish_reason(state: RequestState) -> str | None:
    return state.finish.type if state.finish else None


def _versions(engine: EmbeddedEngine, state: RequestState) -> dict:
    spans = [{**s, "version": str(s["version"])} for s in state.version_spans()]
    version = spans[-1]["version"] if spans else str(engine.weight_version)
    return {"weight_version": version, "weight_versions": spans}


def _usage(prompt_len: int, states: list[RequestState]) -> dict:
    completion = sum(len(s.output_ids) for s in states)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


class _Decoder:
    """Incremental text of one request: the full decode each time, holding back a half-decoded character."""

    def __init__(self, engine: EmbeddedEngine, skip_special: bool) -> None:
        self._tok = engine.tokenizer
        self._skip = skip_special
        self.sent = 0

    def text(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if self._tok is not None else ""

    def delta(self, ids: list[int], final: bool) -> str:
        text = self.text(ids)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        out, self.sent = text[self.sent :], max(self.sent, len(text))
        return out


def _completion_logprobs(engine: EmbeddedEngine, state: RequestState, top: int, start: int = 0) -> dict:
    tok = engine.tokenizer
    tokens = [tok.decode([t]) if tok is not None else f"token_id:{t}" for t in state.output_ids[start:]]
    lps = state.logprobs[start : start + len(tokens)]
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top_lps = [{t: lp} for t, lp in zip(tokens, lps, strict=True)] if top > 0 else [None] * len(tokens)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_lps, "text_offset": offsets}


def _chat_logprobs(engine: EmbeddedEngine, state: RequestState, top: int, start: int = 0) -> dict:
    tok = engine.tokenizer
    content = []
    for t, lp in zip(state.output_ids[start:], state.logprobs[start:], strict=True):
        text = tok.decode([t]) if tok is not None else f"token_id:{t}"
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top > 0 else []
        content.append(entry)
    return {"content": content}


def build_openai_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()
    model_name = Path(engine.model_path).name

    @router.get("/v1/models")
    async def models() -> Response:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "slipstream"}
        return json_response({"object": "list", "data": [card]})

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await decode_body(request, CompletionRequest, engine.cfg.max_request_bytes)
        _check_common(req, engine.cfg)
        if req.echo:
            raise RequestError("echo is not supported")
        if req.logprobs is not None and not 0 <= req.logprobs <= 1:
            raise RequestError("logprobs may be 0 or 1: only the sampled token's logprob is computed")
        _check_max_tokens("max_tokens", req.max_tokens)
        ids = await _prompt_ids(engine, req.prompt)
        base, states = await _submit_n(engine, req, ids, _sampling(req, req.max_tokens))
        top = req.logprobs if req.logprobs is not None else -1

        def choice(i: int, state: RequestState, text: str, start: int) -> dict:
            c = {"index": i, "text": text, "finish_reason": _finish_reason(state), **_versions(engine, state)}
            c["logprobs"] = _completion_logprobs(engine, state, top, start) if top >= 0 else None
            if state.finish and state.finish.type == "stop":
                c["stop_reason"] = state.finish.matched
            if req.return_token_ids:
                c["token_ids"] = state.output_ids[start:]
                c["prompt_token_ids"] = ids if start == 0 else None
            return c

        envelope = {
            "id": f"cmpl-{base}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        return await _respond(
            engine, req, request, ids, states, envelope, choice, skip=req.skip_special_tokens
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await decode_body(request, ChatCompletionRequest, engine.cfg.max_request_bytes)
        _check_common(req, engine.cfg)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 1:
            raise RequestError("top_logprobs may be 0 or 1: only the sampled token's logprob is computed")
        check_messages(req.messages)
        _check_template_trust(req, engine.cfg)
        max_tokens = _chat_max_tokens(req)
        ids = await _chat_prompt_ids(engine, req)
        max_tokens = max_tokens if max_tokens is not None else engine.cfg.max_model_len - len(ids)
        base, states = await _submit_n(engine, req, ids, _sampling(req, max_tokens))
        top = (req.top_logprobs or 0) if req.logprobs else -1

        def choice(i: int, state: RequestState, text: str, start: int) -> dict:
            key = "delta" if req.stream else "message"
            c = {
                "index": i,
                key: {"role": "assistant", "content": text},
                "finish_reason": _finish_reason(state),
            }
            c.update(_versions(engine, state))
            c["logprobs"] = _chat_logprobs(engine, state, top, start) if top >= 0 else None
            if req.return_token_ids:
                c["token_ids"] = state.output_ids[start:]
                c["prompt_token_ids"] = ids if start == 0 else None
            return c

        kind = "chat.completion.chunk" if req.stream else "chat.completion"
        envelope = {
            "id": f"chatcmpl-{base}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
        }
        return await _respond(
            engine, req, request, ids, states, envelope, choice, skip=req.skip_special_tokens
        )

    return router


ChoiceFn = Callable[[int, RequestState, str, int], dict]


async def _respond(engine, req, request, ids, states, envelope, choice: ChoiceFn, *, skip: bool) -> Response:
    if req.stream:
        chunks = _stream_chunks(engine, req, ids, states[0], envelope, choice, skip)
        return StreamingResponse(chunks, media_type="text/event-stream")
    await asyncio.gather(*(wait_or_abort_on_disconnect(engine, s, request) for s in states))
    decoder = _Decoder(engine, skip)
    choices = [choice(i, s, decoder.text(s.output_ids), 0) for i, s in enumerate(states)]
    body = {**envelope, "choices": choices, "usage": _usage(len(ids), states)}
    body["metadata"] = _versions(engine, states[-1])
    return json_response(body)


async def _stream_chunks(
    engine, req, ids, state, envelope, choice: ChoiceFn, skip: bool
) -> AsyncIterator[bytes]:
    decoder = _Decoder(engine, skip)
    sent_tokens = 0
    try:
        async for _ in engine.stream(state):
            text = decoder.delta(state.output_ids, final=state.done)
            chunk = {**envelope, "choices": [choice(0, state, text, sent_tokens)]}
            if not state.done:
                chunk["choices"][0]["finish_reason"] = None
            sent_tokens = len(state.output_ids)
            yield sse(chunk)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**envelope, "choices": [], "usage": _usage(len(ids), [state])})
        yield SSE_DONE
    finally:
        if not state.done:
            engine.abort(state.rid, "client disconnected")


def _check_max_tokens(name: str, value: int | None) -> None:
    """0 would mean "no new token" to OpenAI and "no limit" to a falsy test; like vLLM, refuse it."""
    if value is not None and value < 1:
        raise RequestError(f"{name} must be at least 1, got {value}")


def _chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` wins over the deprecated ``max_tokens``; None: up to the context length."""
    _check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    _check_max_tokens("max_tokens", req.max_tokens)
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check_messages(messages: list[dict]) -> None:
    """Each message needs a known role and content (a string or a list of text parts); 400 names which.

    An assistant message that carries ``tool_calls`` may omit its content, as OpenAI allows.
    """
    if not messages:
        raise RequestError("messages is empty")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None:
            if role == "assistant" and message.get("tool_calls"):
                continue
            raise RequestError(f"messages[{i}].content is missing (a {role} message needs content)")
        _check_content(i, content)


def _check_content(index: int, content: object) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise RequestError(
                f'messages[{index}].content[{j}] must be a text part {{"type": "text", "text": "..."}}'
                " (this server reads text only)"
            )


def _check_template_trust(req: ChatCompletionRequest, cfg: EmbeddedServerConfig) -> None:
    sent = req.chat_template is not None or "chat_template" in (req.chat_template_kwargs or {})
    if sent and not cfg.trust_request_chat_template:
        raise RequestError(
            "chat_template: this server renders only the model's own chat template; a template sent with the"
            " request is accepted only when the server runs with --trust-request-chat-template"
        )


async def _prompt_ids(engine: EmbeddedEngine, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    return await encode_text(engine, prompt)


async def _chat_prompt_ids(engine: EmbeddedEngine, req: ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    if tok is None or not (getattr(tok, "chat_template", None) or req.chat_template):
        raise RequestError("this model has no chat template: use /v1/completions or /generate")
    return await asyncio.to_thread(_render_chat, tok, req, max_prompt_tokens(engine))


def _render_chat(tok, req: ChatCompletionRequest, max_tokens: int) -> list[int]:
    """Runs in a worker thread (see app.py): template rendering and tokenising are CPU-bound."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    try:
        text = tok.apply_chat_template(
            req.messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as err:  # noqa: BLE001 - a template error is the caller's malformed messages
        raise RequestError(f"cannot render messages with the chat template: {err}") from err
    return encode_bounded(tok, text, max_tokens)
