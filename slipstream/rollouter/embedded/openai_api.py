"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` on the embedded engine.

For tools and people that speak OpenAI (the official ``openai`` client, evaluation harnesses). The RL path
uses ``/generate``; these routes run the same engine and add vLLM's ``return_token_ids`` extension and, as
SGLang does, the weight versions (``metadata.weight_version``/``weight_versions``, and per choice).

Log-probabilities: the engine computes the sampled token's log-probability only, so ``logprobs`` (completions)
may be 0 or 1 and ``top_logprobs`` (chat) 0 or 1; larger values get a 400 rather than a shorter list.
Stop strings are not supported (use ``stop_token_ids``); streaming supports ``n == 1``.
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
from slipstream.rollouter.embedded.app import (
    SSE_DONE,
    decode_body,
    json_response,
    sse,
    wait_or_abort_on_disconnect,
)
from slipstream.rollouter.embedded.engine import EmbeddedEngine, RequestError, RequestState
from slipstream.rollouter.embedded.schemas import ChatCompletionRequest, CompletionRequest, _OpenAISampling


def _check_common(req: _OpenAISampling) -> None:
    if req.stop:
        raise RequestError("stop strings are not supported by this server; use stop_token_ids")
    if req.seed is not None:
        raise RequestError("seed is not supported per request; the server's sampling seed is set at start-up")
    if req.presence_penalty or req.frequency_penalty:
        raise RequestError("presence_penalty and frequency_penalty are not supported (must be 0)")
    if req.n < 1:
        raise RequestError(f"n must be at least 1, got {req.n}")
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
        req = await decode_body(request, CompletionRequest)
        _check_common(req)
        if req.echo:
            raise RequestError("echo is not supported")
        if req.logprobs is not None and not 0 <= req.logprobs <= 1:
            raise RequestError("logprobs may be 0 or 1: only the sampled token's logprob is computed")
        ids = _prompt_ids(engine, req.prompt)
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
        req = await decode_body(request, ChatCompletionRequest)
        _check_common(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 1:
            raise RequestError("top_logprobs may be 0 or 1: only the sampled token's logprob is computed")
        ids = _chat_prompt_ids(engine, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or engine.cfg.max_model_len - len(ids)
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


def _prompt_ids(engine: EmbeddedEngine, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer: send the prompt as a list of token ids")
    return engine.tokenizer.encode(prompt, add_special_tokens=False)


def _chat_prompt_ids(engine: EmbeddedEngine, req: ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions or /generate")
    if not req.messages:
        raise RequestError("messages is empty")
    try:
        text = tok.apply_chat_template(
            req.messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as err:  # noqa: BLE001 - a template error is the caller's malformed messages
        raise RequestError(f"cannot render messages with the chat template: {err}") from err
    return tok.encode(text, add_special_tokens=False)
