"""Client of a vLLM server launched with ``VLLM_SERVER_DEV_MODE=1`` (``slipstream.serverapi.vllm``
describes the API and pins its release).

Two token-in/token-out routes, chosen with ``api=`` (the description's route names):

* ``"completions"`` (default, works on every vLLM server): ``POST /v1/completions`` with ``prompt`` as token
  ids, ``logprobs: 0`` (the sampled token's logprob), ``return_token_ids: true`` (``choices[0].token_ids``)
  and ``return_weight_versions: true`` (``choices[0].weight_versions`` spans). vLLM names the engine
  request ``cmpl-<request_id>-0``, which is what ``/abort_requests`` needs (the description's
  ``engine_id``).
* ``"generate"``: the native ``POST /inference/v1/generate`` (servers started with ``--tokens-only``):
  ``token_ids`` + a vLLM ``sampling_params`` dict; logprobs in ``choices[0].logprobs.content[].logprob``;
  abort with ``/inference/v1/abort_requests``. vLLM names that engine request ``generate-tokens-<request_id>``
  (``entrypoints/scale_out/token_in_token_out/serving.py``), so that is the id an abort must name.

Dev-mode control (abort, pause, resume: the base class's, built from the description): ``POST /pause?
mode=abort|wait|keep`` (our ``in_place`` is vLLM's ``keep``), ``/resume``, ``/abort_requests
{"request_ids": [...]}`` (empty: all); ``GET /weight_info`` for the version. While paused in
``abort``/``wait`` mode vLLM answers new requests with 503; :meth:`VLLMClient.generate` retries those
with backoff until resume or the client's timeout. Aborted requests come back with ``finish_reason ==
"abort"`` and their partial tokens. A response without weight-version spans gets every token stamped
with the version ``/weight_info`` reports right after it.

Launch vLLM with ``--logprobs-mode processed_logprobs`` (launch.py does) so logprobs are computed after
temperature, like the embedded server's and SGLang's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Literal

from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.rollouter.clients.base import ServerClient, ServerError, expand_spans, parse_version
from slipstream.serverapi import VLLM, ServerAPI

if TYPE_CHECKING:
    from slipstream.rollouter.config import RolloutConfig

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _vllm_sampling(sampling: SamplingParams) -> dict:
    params = {
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # vLLM: 0 disables top-k
        "logprobs": 0,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


def build_completions_payload(input_ids: list[int], sampling: SamplingParams, rid: str) -> dict:
    return {
        "prompt": list(input_ids),
        **_vllm_sampling(sampling),
        "return_token_ids": True,
        "return_weight_versions": True,
        "request_id": rid,
        "stream": False,
    }


def build_generate_payload(input_ids: list[int], sampling: SamplingParams, rid: str) -> dict:
    return {
        "request_id": rid,
        "token_ids": list(input_ids),
        "sampling_params": _vllm_sampling(sampling),
        "stream": False,
    }


def _finish(reason: str | None) -> str:
    return _FINISH.get(reason or "abort", "abort")


def parse_completions_response(body: dict, *, rid: str, server: str, fallback_version: int) -> GenerateOutput:
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"malformed /v1/completions response from {server}: missing {err}") from err
    prompt_ids = choice.get("prompt_token_ids") or []  # return_token_ids puts them on the choice
    return _output(
        choice,
        token_ids,
        logprobs,
        body,
        prompt_ids,
        rid=rid,
        server=server,
        fallback_version=fallback_version,
    )


def parse_generate_response(body: dict, *, rid: str, server: str, fallback_version: int) -> GenerateOutput:
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"malformed /inference/v1/generate response from {server}: missing {err}") from err
    prompt_ids = body.get("prompt_token_ids") or []  # the generate reply carries them at the top level
    return _output(
        choice,
        token_ids,
        logprobs,
        body,
        prompt_ids,
        rid=rid,
        server=server,
        fallback_version=fallback_version,
    )


def _output(
    choice, token_ids, logprobs, body, prompt_ids, *, rid, server, fallback_version
) -> GenerateOutput:
    if len(logprobs) != len(token_ids) or any(lp is None for lp in logprobs):
        raise ValueError(f"response from {server} has {len(token_ids)} tokens but logprobs {logprobs[:4]}...")
    usage = body.get("usage") or {}
    return GenerateOutput(
        output_ids=token_ids,
        logprobs=[float(lp) for lp in logprobs],
        versions=expand_spans(choice.get("weight_versions"), len(token_ids), fallback_version),
        finish_reason=_finish(choice.get("finish_reason")),
        prompt_tokens=int(usage.get("prompt_tokens", len(prompt_ids))),
        rid=rid,
        server=server,
    )


class VLLMClient(ServerClient):
    """Client of ``vllm serve`` in dev mode (see the module docstring)."""

    kind = "vllm"
    default_api = VLLM

    def __init__(
        self,
        base_url: str,
        *,
        api: Literal["completions", "generate"] = "completions",
        server_api: ServerAPI | None = None,
        timeout_s: float = 3600.0,
        max_connections: int = 1024,
        retry_interval_s: float = 0.05,
    ) -> None:
        if api not in ("completions", "generate"):
            raise ValueError(f"api must be 'completions' or 'generate', got {api!r}")
        super().__init__(
            base_url, server_api=server_api, timeout_s=timeout_s, max_connections=max_connections
        )
        self.route = self.api = api  # the generate route: abort follows it (``api`` is its old name)
        self.retry_interval_s = retry_interval_s

    @classmethod
    def options_from(cls, cfg: RolloutConfig) -> dict:
        return {"api": cfg.vllm.route}

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateOutput:
        rid = rid or uuid.uuid4().hex
        if self.api == "completions":
            payload, parse = build_completions_payload, parse_completions_response
        else:
            payload, parse = build_generate_payload, parse_generate_response
        path = self.server_api.route(self.route).generate.path
        body = payload(input_ids, sampling, rid)
        if session_id is not None and self.api == "completions":
            body["session_id"] = session_id
        response = await self._post_retrying_paused(path, body)
        data = response.json()
        fallback = 0
        if not (data.get("choices") or [{}])[0].get("weight_versions"):
            fallback = await self.weight_version()
        try:
            return parse(data, rid=rid, server=self.base_url, fallback_version=fallback)
        except ValueError as err:
            raise ServerError(self.base_url, response.status_code, str(err)) from err

    async def _post_retrying_paused(self, path: str, body: dict):
        """POST, retrying vLLM's 503 (paused in abort/wait mode) with backoff until the client's timeout."""
        deadline = time.monotonic() + self.timeout_s
        delay = self.retry_interval_s
        while True:
            try:
                return await self._request("POST", path, json=body)
            except ServerError as err:
                if err.status != 503 or time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def weight_version(self) -> int:
        info = self.server_api.weight_version
        body = (await self._request(info.method, info.path, timeout=30.0)).json()
        return parse_version(body.get("weight_version", 0))

    async def model_info(self) -> dict:
        info = self.server_api.model_info
        models = (await self._request(info.method, info.path, timeout=30.0)).json().get("data") or [{}]
        card = models[0]
        return {
            "model_path": card.get("root") or card.get("id"),
            "served_model_name": card.get("id"),
            "max_model_len": card.get("max_model_len"),
            "weight_version": await self.weight_version(),
        }
