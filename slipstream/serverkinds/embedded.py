"""The ``embedded`` server kind: our own server (``slipstream serve``, ``rollouter/embedded/``).

**Client**: it speaks SGLang's native API, so its client is :class:`~slipstream.serverkinds.sglang.SGLangClient`
built with the embedded description (``serverapi.EMBEDDED``: its own pause modes).

**Weights** (:class:`EmbeddedAdapter`): SGLang's sequence, except that it stages: no pause before the transfer
(it keeps generating), exact bucket layout in ``slipstream_bucket`` (chunks, mixed dtypes), and no pause or
continue call at all: when in-flight requests must be aborted, ``/end_weight_update {abort_running: true}``
aborts them under a pause the server takes and lifts itself. With an in-band stream (``ipc``, ``nixl``) the
version travels in the stream (``/begin_weight_update {stream}``) and the per-bucket calls disappear; it is the
only kind that takes those streams and the only one started without GPUs by default.

**Launch**: ``python -m slipstream.rollouter.serve`` with the flags of ``rollout.embedded``, and ``--open``
when it is launched without a token.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import msgspec

from slipstream.serverapi import EMBEDDED
from slipstream.serverkinds import ServerKind
from slipstream.serverkinds.sglang import SGLangAdapter, SGLangClient
from slipstream.utils.http_client import HTTPClientError
from slipstream.weightsync.adapters import slipstream_layout
from slipstream.weightsync.errors import TransferError

if TYPE_CHECKING:
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.weightsync.base import TransportName
    from slipstream.weightsync.buckets import Layout
    from slipstream.weightsync.types import BucketMeta


class EmbeddedAdapter(SGLangAdapter):
    """Our embedded server (``serverapi.EMBEDDED``): SGLang's sequence, staged (see the module docstring)."""

    kind = "embedded"
    api = EMBEDDED

    def layout(self) -> Layout | None:
        return None if self.per_tensor else slipstream_layout(self.cfg)

    async def ranks(self) -> int:
        return 1

    def init_extras(self) -> dict:
        return {"timeout_s": self.cfg.timeout_s}  # our receiver waits as long as we do

    def begin_body(self, version: int, stream: TransportName | None = None) -> dict:
        body: dict[str, Any] = {"weight_version": version}
        if stream is not None:  # the open link's stream carries the version
            body["stream"] = stream
        return body

    def update_body(self, meta: BucketMeta) -> dict:
        body = super().update_body(meta)
        body["flush_cache"] = False
        if not self.per_tensor:
            body["slipstream_bucket"] = msgspec.to_builtins(meta)
        return body

    async def end(self, version: int, *, abort_running: bool = False) -> None:
        body: dict[str, Any] = {"weight_version": version}
        if abort_running:
            body["abort_running"] = True
        await self.request(self.api.weights.end, json=body)

    async def recover(self, version: int) -> None:
        if self.control.paused:  # only what this adapter paused, at the switch
            try:
                await self.control.resume()
            except TransferError:
                pass
            self.control.paused = None

    async def nixl_prepare(self) -> bytes:
        path = self.api.weights.stream_prepare.format(stream="nixl")
        try:
            resp = await self.http.post(f"{self.url}{path}", timeout=self.cfg.timeout_s)
        except HTTPClientError as err:
            raise TransferError(f"{self.url}{path}: {err}") from err
        if resp.status_code != 200:
            raise TransferError(f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.content

    async def nixl_connect(self, sender_json: dict, group_name: str) -> None:
        path = self.api.weights.stream_connect.format(stream="nixl")
        await self.call("POST", path, json={"sender": sender_json, "group_name": group_name})


def embedded_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    """``python -m slipstream.rollouter.serve`` for ``model`` on ``host:port`` with ``cfg.embedded``'s flags."""
    from slipstream.rollouter.serve import config_to_args

    base = [sys.executable, "-m", "slipstream.rollouter.serve", "--model", model, "--host", host]
    return base + ["--port", str(port), *config_to_args(cfg.embedded)]


def embedded_env(cfg: RolloutConfig) -> dict[str, str]:
    return {"TOKENIZERS_PARALLELISM": "false"}


def _always(cfg: RolloutConfig) -> bool:
    return True


def embedded_dtype(cfg: RolloutConfig, model_path: str, model_dtype: str) -> str:
    return cfg.embedded.dtype  # ours loads the checkpoint in rollout.embedded.dtype, whatever it holds


def embedded_kv_tokens(cfg: RolloutConfig) -> int:
    return cfg.embedded.kv_cache_tokens


def embedded_on_gpu(cfg: RolloutConfig) -> bool:
    return cfg.embedded.device == "cuda"


def embedded_cpu_threads(cfg: RolloutConfig) -> int | None:
    return None if embedded_on_gpu(cfg) else cfg.embedded.num_threads


KIND = ServerKind(
    name="embedded",
    api=EMBEDDED,
    client=SGLangClient,
    adapter=EmbeddedAdapter,
    command=embedded_command,
    env=embedded_env,
    title="embedded",
    local_model_only=True,
    needs_gpus=False,
    open_flag="--open",
    streams=("ipc", "nixl"),
    colocated_transports=("ipc", "auto", "nixl"),
    rebuilds_send_less=True,
    takes_send_less=_always,
    served_dtype=embedded_dtype,
    kv_cache_tokens=embedded_kv_tokens,
    on_gpu=embedded_on_gpu,
    cpu_threads=embedded_cpu_threads,
    cpu_threads_key="rollout.embedded.num_threads",
)
