"""The ``sglang`` server kind: SGLang's client, weight adapter and launch command (``slipstream.serverkinds``).

**Client** (:class:`SGLangClient`) of SGLang's native API, which our embedded server also speaks
(``slipstream.serverapi.sglang`` describes the API and pins its release; the ``embedded`` kind gives it the
embedded description).

Request: ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop_token_ids``), ``return_logprob: true`` and ``rid``. Response: ``output_ids`` and
``meta_info`` with ``finish_reason.type``, ``output_token_logprobs`` (``[logprob, token_id, text|null]``
per token) and ``weight_versions`` spans (``{version, start, end}``, end exclusive; SGLang >= 0.5.23).
A server without spans gets every token stamped with ``meta_info.weight_version``.

Abort, pause and resume are the base class's (sent by the description's control requests): an aborted
request's pending ``/generate`` returns its partial output with ``finish_reason.type == "abort"``; during a
pause SGLang holds new requests until ``/continue_generation`` (no retry needed here).

**Weights** (:class:`SGLangAdapter`): ``/pause_generation {mode}`` → ``/begin_weight_update {}`` → N ×
``/update_weights_from_distributed`` (``load_format: flattened_bucket``, one dtype per bucket,
``weight_version``, ``flush_cache`` false after an ``in_place`` pause since flushing fails while requests hold
the cache) → ``/end_weight_update {}`` → ``/continue_generation {}``. Group: ``/init_weights_update_group``;
worker ranks are ``rank_offset + tp_rank``, so a server counts ``tp_size`` ranks. Its receiver builds each
bucket as one typed tensor, so an NCCL sender sends typed buckets (``typed_buckets``).

**Launch**: ``python -m sglang.launch_server`` with ``--weight-version 0``; ``--context-length`` bounds the
sequence and ``--json-model-override-args`` overrides the model's positions.
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from typing import TYPE_CHECKING, Any

from slipstream.agents.protocol import TOKEN_SINK, GenerateOutput, SamplingParams
from slipstream.rollouter.clients.base import (
    ServerClient,
    ServerError,
    ServerUnavailable,
    decode_routed_experts,
    expand_spans,
    parse_version,
)
from slipstream.serverapi import SGLANG
from slipstream.serverkinds import ServerKind
from slipstream.utils.http_client import HTTPClientError
from slipstream.weightsync.adapters import GroupSpec, ServerAdapter, bucket_entries
from slipstream.weightsync.errors import TransferError

if TYPE_CHECKING:
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.weightsync.types import BucketMeta

# ------------------------------------------------------------------------------------------------ client

_FINISH_TYPES = ("stop", "length", "abort")


def build_generate_payload(input_ids: list[int], sampling: SamplingParams, rid: str) -> dict:
    params: dict = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    payload = {
        "input_ids": list(input_ids),
        "sampling_params": params,
        "return_logprob": True,
        "rid": rid,
        "stream": False,
    }
    if sampling.return_routed_experts:
        payload["return_routed_experts"] = True  # SGLang's request field
    return payload


def parse_generate_response(body: dict, *, rid: str, server: str) -> GenerateOutput:
    """A :class:`GenerateOutput` from SGLang's ``/generate`` response; raises ``ValueError`` if malformed."""
    try:
        output_ids = [int(t) for t in body["output_ids"]]
        meta = body["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed /generate response from {server}: missing {err}") from err
    if len(entries) != len(output_ids):
        raise ValueError(
            f"/generate response from {server} has {len(output_ids)} output_ids but "
            f"{len(entries)} output_token_logprobs (was return_logprob sent?)"
        )
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in _FINISH_TYPES:
        finish_type = "abort"
    fallback = parse_version(meta.get("weight_version", 0))
    routes = meta.get("routed_experts")
    return GenerateOutput(
        output_ids=output_ids,
        logprobs=[float(e[0]) for e in entries],
        versions=expand_spans(meta.get("weight_versions"), len(output_ids), fallback),
        finish_reason=finish_type,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        rid=str(meta.get("id", rid)),
        server=server,
        routed_experts=decode_routed_experts(routes) if routes else None,
    )


class SGLangClient(ServerClient):
    """Client of a real SGLang server or of ``slipstream serve`` (same API)."""

    kind = "sglang"
    default_api = SGLANG

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateOutput:
        rid = rid or uuid.uuid4().hex
        generate = self.server_api.route(self.route).generate
        payload = build_generate_payload(input_ids, sampling, rid)
        sink = TOKEN_SINK.get()
        if sink is not None:
            return await self._generate_streaming(generate.method, generate.path, payload, rid, sink)
        response = await self._request(generate.method, generate.path, json=payload)
        try:
            return parse_generate_response(response.json(), rid=rid, server=self.base_url)
        except ValueError as err:
            raise ServerError(self.base_url, response.status_code, str(err)) from err

    async def _generate_streaming(
        self, method: str, path: str, payload: dict, rid: str, sink
    ) -> GenerateOutput:
        """``/generate`` with ``stream: true``: each SSE chunk holds the output so far (cumulative, as SGLang
        sends it by default); the ids it adds go to ``sink`` at once, and the last chunk is the result."""
        last, seen = None, 0
        try:
            async for status, line in self._http.stream_lines(method, path, json={**payload, "stream": True}):
                if status == 503:
                    raise ServerUnavailable(self.base_url, line.decode(errors="replace")[:500], status=503)
                if status >= 400:
                    raise ServerError(self.base_url, status, line.decode(errors="replace")[:500])
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                last = json.loads(line[5:])
                ids = [int(t) for t in last.get("output_ids") or []]
                if len(ids) > seen:
                    sink(ids[seen:])
                    seen = len(ids)
        except HTTPClientError as err:
            raise ServerUnavailable(self.base_url, f"{method} {path}: {err}") from err
        if last is None:
            raise ServerError(self.base_url, 200, "the /generate stream ended without a chunk")
        try:
            return parse_generate_response(last, rid=rid, server=self.base_url)
        except ValueError as err:
            raise ServerError(self.base_url, 200, str(err)) from err

    async def model_info(self) -> dict:
        info = self.server_api.model_info
        return (await self._request(info.method, info.path, timeout=30.0)).json()

    async def weight_version(self) -> int:
        return parse_version((await self.model_info()).get("weight_version", 0))


# ------------------------------------------------------------------------------------------------ weights


class SGLangAdapter(ServerAdapter):
    """SGLang (``serverapi.SGLANG``; see the module docstring)."""

    kind = "sglang"
    api = SGLANG

    async def ranks(self) -> int:
        info = await self.request(self.api.weights.ranks)
        return int(info.get("tp_size", 1) or 1)

    async def init_group(self, spec: GroupSpec) -> None:
        self.group_name = spec.group_name
        await self.request(
            self.api.weights.init_group,
            json={
                "master_address": spec.master_address,
                "master_port": spec.master_port,
                "rank_offset": spec.rank_offset,
                "world_size": spec.world_size,
                "group_name": spec.group_name,
                "backend": spec.backend,
                **self.init_extras(),
            },
        )

    def init_extras(self) -> dict:
        return {}

    async def destroy_group(self, group_name: str) -> None:
        await self.request(self.api.weights.destroy_group, json={"group_name": group_name})

    def update_body(self, meta: BucketMeta) -> dict:
        names, dtypes, shapes = bucket_entries(meta)
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.group_name,
            "weight_version": str(meta.version),
            # Flushing fails while in-place-paused requests hold the cache; after abort/retract it is
            # needed once the last bucket has landed.
            "flush_cache": not self.mode.keeps_requests and meta.last,
        }
        if not self.per_tensor:
            body["load_format"] = "flattened_bucket"
        return body

    async def update(self, meta: BucketMeta) -> None:
        if meta.entries:
            await self.request(self.api.weights.update, json=self.update_body(meta))

    async def recover(self, version: int) -> None:
        with contextlib.suppress(TransferError):  # close the session (none may be open)
            await self.end(version)
        with contextlib.suppress(TransferError):  # resume whether or not the pause was sent
            await self.control.resume()


# ------------------------------------------------------------------------------------------------ launch


def sglang_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    """``python -m sglang.launch_server`` for ``model`` on ``host:port``, starting at weight version 0."""
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host]
    return base + ["--port", str(port), "--weight-version", "0"]


def _unfiltered_logprobs(cfg: RolloutConfig) -> str:
    return (
        "SGLang returns the log of its tempered softmax, before top-k / top-p renormalise it, so its "
        "logprobs are not of the distribution it samples from"
    )


KIND = ServerKind(
    name="sglang",
    api=SGLANG,
    client=SGLangClient,
    adapter=SGLangAdapter,
    command=sglang_command,
    module="sglang",
    extra="sglang",
    title="SGLang",
    needs_gpus=True,
    context_flag="--context-length",
    position_flag="--json-model-override-args",
    typed_buckets=True,
    unfiltered_logprobs=_unfiltered_logprobs,
    send_less_missing=(
        "SGLang loads dense tensors only, and its one in-memory LoRA route (/load_lora_adapter_from_tensors) "
        "unpickles what it is sent, which Slipstream never sends on a socket"
    ),
    colocated_missing=(
        "a CUDA-IPC weight transport to SGLang (update_weights_from_tensor / update_weights_from_ipc)"
    ),
)
