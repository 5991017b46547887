"""HTTP front of the embedded engine: SGLang's native RL subset, OpenAI routes, weight-update routes.

The native routes use SGLang 0.5.23's paths, field names and response shapes, so one client
(:class:`slipstream.serverkinds.sglang.SGLangClient`) drives this server and real SGLang servers:

=========================  ==========================================================================
``POST /generate``         ``input_ids`` (or ``text``), ``sampling_params``, ``return_logprob``, ``stream``
                           (SSE, cumulative chunks), ``rid`` → ``output_ids``, ``text``, ``meta_info``;
                           ``return_routed_experts`` (MoE models): ``meta_info.routed_experts``, base64 of
                           the ``.npy`` of ``[prompt + output - 1, layers, k]`` uint8 expert ids, vLLM's
                           encoding (on the finished request: a stream's last chunk)
``POST /abort_request``    ``{"rid"}`` or ``{"abort_all": true}``: the pending ``/generate`` returns its
                           partial output with ``finish_reason.type == "abort"``
``POST /pause_generation`` ``{"mode": "abort" | "in_place"}``; new requests wait until continue
``POST /continue_generation``
``POST /flush_cache``      accepted; there is no prefix cache to flush (see engine.py)
``GET /model_info``        ``model_path``, ``weight_version``, limits
``GET /health``            200 while the generation loop runs and makes progress, else 503 with the reason
                           (a stall: requests in flight and no token for ``stall_timeout_s``)
=========================  ==========================================================================

Control needs a token: pause/continue, abort, the weight routes and every other route that changes the
server's state answer 401/403 without ``Authorization: Bearer <token>`` when the server has one; generation,
``/model_info`` and ``/health`` stay open on loopback (auth.py has the whole policy).

Versions are strings on the wire, as SGLang sends them (``"3"``); clients turn them back into ints.
Errors are ``{"error": {"message", "type", "code"}}`` with 400 for bad input, 413 for a body over
``max_request_bytes``, 503 when the engine is down. Request bodies are decoded with msgspec (schemas.py)
rather than pydantic so unknown fields are rejected with the offending path in the message.

The event loop serves every request, so nothing slow runs on it: text is tokenised (and chat templates
rendered) in a worker thread, and a body is refused as soon as it outgrows the limit rather than read whole.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients.base import encode_routed_experts
from slipstream.rollouter.embedded.auth import TokenGate
from slipstream.rollouter.embedded.engine import EmbeddedEngine, EngineUnavailable, RequestError, RequestState
from slipstream.rollouter.embedded.http import (
    SSE_DONE,
    BodyTooLarge,
    decode_body,
    encode_text,
    error_response,
    json_response,
    sse,
    wait_or_abort_on_disconnect,
)
from slipstream.rollouter.embedded.schemas import AbortReq, ContinueReq, GenerateReqInput, PauseReq
from slipstream.utils.http_auth import check_bind, env_token
from slipstream.utils.logging import get_logger
from slipstream.utils.net import LOOPBACK, is_loopback

log = get_logger(__name__)


def meta_info(
    engine: EmbeddedEngine, state: RequestState, return_logprob: bool, with_text: bool, routes: bool = False
) -> dict:
    spans = state.version_spans()
    meta = {
        "id": state.rid,
        "finish_reason": state.finish.to_json() if state.finish else None,
        "prompt_tokens": len(state.input_ids),
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        "weight_version": str(spans[-1]["version"] if spans else engine.weight_version),
        "weight_versions": [{**s, "version": str(s["version"])} for s in spans],
        "e2e_latency": time.perf_counter() - state.created,
    }
    if return_logprob:
        texts = _token_texts(engine, state.output_ids) if with_text else [None] * len(state.output_ids)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, tok, txt] for lp, tok, txt in zip(state.logprobs, state.output_ids, texts, strict=True)
        ]
    if routes and state.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(state.routed_experts.numpy())
    return meta


def _token_texts(engine: EmbeddedEngine, ids: list[int]) -> list[str | None]:
    tok = engine.tokenizer
    return [tok.decode([i]) for i in ids] if tok is not None else [None] * len(ids)


def generate_payload(engine: EmbeddedEngine, state: RequestState, req: GenerateReqInput) -> dict:
    out: dict = {"output_ids": list(state.output_ids)}
    if engine.tokenizer is not None:
        skip = req.sampling_params.skip_special_tokens
        out["text"] = engine.tokenizer.decode(state.output_ids, skip_special_tokens=skip)
    out["meta_info"] = meta_info(
        engine, state, req.return_logprob, req.return_text_in_logprobs, req.return_routed_experts
    )
    return out


async def prompt_ids_of(engine: EmbeddedEngine, req: GenerateReqInput) -> list[int]:
    if (req.input_ids is None) == (req.text is None):
        raise RequestError("give exactly one of input_ids and text")
    if req.input_ids is not None:
        return req.input_ids
    return await encode_text(engine, req.text)


def check_generate_options(req: GenerateReqInput, engine: EmbeddedEngine | None = None) -> None:
    if req.logprob_start_len != -1:
        raise RequestError("logprob_start_len: only -1 (output tokens only) is supported")
    if req.top_logprobs_num != 0:
        raise RequestError("top_logprobs_num: only 0 is supported (the sampled token's logprob is returned)")
    if req.return_routed_experts and engine is not None and not engine.records_routes:
        raise RequestError("return_routed_experts: the served model is not a mixture of experts")


async def run_generate(engine: EmbeddedEngine, req: GenerateReqInput, request: Request) -> Response:
    check_generate_options(req, engine)
    sp = req.sampling_params
    sampling = SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop_token_ids=sp.stop_token_ids,
    )
    rid = req.rid or uuid.uuid4().hex
    ids = await prompt_ids_of(engine, req)
    state = await engine.submit(ids, sampling, rid=rid, ignore_eos=sp.ignore_eos)
    if req.stream:
        return StreamingResponse(_stream_generate(engine, state, req), media_type="text/event-stream")
    await wait_or_abort_on_disconnect(engine, state, request)
    return json_response(generate_payload(engine, state, req))


async def _stream_generate(
    engine: EmbeddedEngine, state: RequestState, req: GenerateReqInput
) -> AsyncIterator[bytes]:
    try:
        async for _ in engine.stream(state):
            yield sse(generate_payload(engine, state, req))
        yield SSE_DONE
    finally:
        if not state.done:  # the client went away mid-stream
            engine.abort(state.rid, "client disconnected")


def build_app(engine: EmbeddedEngine, *, token: str | None = None, host: str = LOOPBACK) -> FastAPI:
    """The FastAPI app; the engine is started and stopped by the app's lifespan.

    ``token`` guards the control routes (None: ``$SLIPSTREAM_SERVER_TOKEN``; "" or unset: none, which only
    a loopback ``host`` allows). ``host`` is the address the app will be served on: beyond loopback,
    generation needs the token too, and a missing token is a ValueError.
    """
    token = env_token() if token is None else token
    check_bind(host, token)
    from contextlib import asynccontextmanager

    from slipstream.rollouter.embedded.openai_api import build_openai_router

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="slipstream embedded inference server", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(TokenGate, token=token, open_reads=is_loopback(host))
    _install_error_handlers(app)
    _add_native_routes(app, engine)
    app.include_router(build_openai_router(engine))
    include_weight_sync_routes(app, engine)
    return app


def include_weight_sync_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    """The single place where the weight-sync HTTP receiver's routes join the app.

    ``slipstream.weightsync.http_receiver.build_router(target)`` serves SGLang's weight-update endpoints
    (``/init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``,
    ``/end_weight_update``, ...) and drives the engine through the ``WeightTarget`` protocol.
    """
    from slipstream.weightsync.http_receiver import build_router

    app.include_router(build_router(engine))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _bad_request(_req: Request, err: RequestError) -> Response:
        return error_response(str(err), 400)

    @app.exception_handler(msgspec.ValidationError)
    async def _invalid(_req: Request, err: msgspec.ValidationError) -> Response:
        return error_response(f"invalid request body: {err}", 400)

    @app.exception_handler(msgspec.DecodeError)
    async def _malformed(_req: Request, err: msgspec.DecodeError) -> Response:
        return error_response(f"malformed JSON body: {err}", 400)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_req: Request, err: BodyTooLarge) -> Response:
        return error_response(str(err), 413)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_req: Request, err: EngineUnavailable) -> Response:
        return error_response(str(err), 503, "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_req: Request, err: Exception) -> Response:
        log.exception("request failed")
        return error_response(f"internal error: {type(err).__name__}: {err}", 500, "internal_error")


def _add_native_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    limit = engine.cfg.max_request_bytes

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await run_generate(engine, await decode_body(request, GenerateReqInput, limit), request)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await decode_body(request, AbortReq, limit)
        if body.abort_all:
            engine.abort_all()
        elif body.rid:
            engine.abort(body.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await decode_body(request, PauseReq, limit)
        await engine.pause(body.mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        await decode_body(request, ContinueReq, limit)
        await engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(content="Cache flushed.", status_code=200)

    @app.get("/model_info")
    async def model_info() -> Response:
        return json_response(model_info_payload(engine))

    @app.get("/health")
    async def health() -> Response:
        problem = engine.health_problem()
        if problem is None:
            return Response(status_code=200)
        log.warning("/health: %s", problem)
        return error_response(problem, 503, "service_unavailable")


def model_info_payload(engine: EmbeddedEngine) -> dict:
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "weight_version": str(engine.weight_version),
        "paused": engine.paused,
        "max_model_len": engine.cfg.max_model_len,
        "vocab_size": engine.vocab_size,
        "eos_token_ids": list(engine.eos_token_ids),
        "num_running_requests": engine.num_running,
        "generated_tokens": engine.generated_tokens,
        "server": "slipstream-embedded",
    }
