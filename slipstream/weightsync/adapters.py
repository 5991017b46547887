"""Server adapters: the exact HTTP sequence each kind of inference server needs to take a new version.

The publisher owns the data plane (a process group or NIXL) and calls an adapter per server for the control
plane. Per version, for every server at once:

  ``before(v)``  →  for each bucket: ``update(meta)`` (the blocking HTTP call, in flight while rank 0
  broadcasts the bucket)  →  ``after(v)``;  ``recover(v)`` after a failure (nothing is left paused).

The endpoints, the pause modes and where the pause goes come from the server's description
(``slipstream.serverapi``: ``api.weights``, ``api.pause_modes``, which also pins the release); pause and
resume are sent by the adapter's :class:`~slipstream.serverapi.ServerControl`, the same object the
rollouter's clients use. What stays here is each request's body. The sequences (inference_apis.md §A–B):

* ``sglang``: ``/pause_generation {mode}`` → ``/begin_weight_update {}`` → N ×
  ``/update_weights_from_distributed`` (``load_format: flattened_bucket``, one dtype per bucket,
  ``weight_version``, ``flush_cache`` false after an ``in_place`` pause since flushing fails while requests
  hold the cache) → ``/end_weight_update {}`` → ``/continue_generation {}``. Group: ``/init_weights_update_
  group``; worker ranks are ``rank_offset + tp_rank``, so a server counts ``tp_size`` ranks.
* ``vllm`` (``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=keep|abort`` → ``/start_weight_update`` →
  N × ``/update_weights {update_info: {names, dtype_names, shapes}}`` (each one packed broadcast whose
  boundaries vLLM re-derives from the names, hence the ``vllm`` bucket layout) → ``/finish_weight_update
  {weight_version}`` → ``/resume``. Group: ``/init_weight_transfer_engine`` with an NCCL unique id we mint
  (the torch-free rendezvous; no pickled store objects), ``packed: true`` and our bucket size.
* ``embedded`` (ours): SGLang's sequence, except that it stages: no pause before the transfer (it keeps
  generating), exact bucket layout in ``slipstream_bucket`` (chunks, mixed dtypes), and no pause or
  continue call at all: when in-flight requests must be aborted, ``/end_weight_update {abort_running:
  true}`` aborts them under a pause the server takes and lifts itself. With ``backend: nixl`` the version travels
  in-band (``/begin_weight_update {stream: "nixl"}``) and the per-bucket calls disappear.

To add a server kind: describe its API in ``slipstream.serverapi``, subclass :class:`ServerAdapter` with
``api`` set to that description, decorate it with ``@register_adapter("<kind>")``.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import msgspec

from slipstream.serverapi import EMBEDDED, SGLANG, VLLM, Call, Endpoint, PauseMode, ServerAPI, ServerControl
from slipstream.utils.http_client import HTTPClient, HTTPClientError
from slipstream.utils.logging import get_logger
from slipstream.utils.registry import Registry
from slipstream.weightsync.base import resolve_device
from slipstream.weightsync.buckets import Layout
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import BucketMeta

log = get_logger(__name__)

ADAPTERS: Registry[type[ServerAdapter]] = Registry(
    "inference server kind", "rollout.backend", plural="kinds", name_attr="kind"
)
register_adapter = ADAPTERS.register
get_adapter_class = ADAPTERS.get


class GroupSpec(msgspec.Struct, kw_only=True):
    """What a server needs to join the trainer's group; ``rank_offset`` is this server's first rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    nccl_unique_id_b64: str = ""


class ServerAdapter:
    """Control-plane calls for one server (see the module docstring for the sequences).

    ``transport`` names the data plane the publisher must open: ``dist`` (a torch.distributed group),
    ``nccl_uid`` (an NCCL communicator from a unique id) or ``nixl`` (in-band NIXL stream). ``api`` is
    the server's description; ``mode`` how ``cfg.pause_mode`` reads on it (a mode it lacks is refused
    here, before any push).
    """

    kind: ClassVar[str]
    api: ClassVar[ServerAPI]
    transport: ClassVar[str] = "dist"

    def __init__(self, url: str, cfg: WeightSyncConfig, http: HTTPClient) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.http = http
        self.per_tensor = cfg.backend == "naive"
        self.group_name = cfg.group_name  # the group of the push in progress (set by init_group)
        self.mode: PauseMode = self.api.pause_mode(cfg.pause_mode)
        self.control = ServerControl(self.api, self._send)

    def layout(self) -> Layout | None:
        """How buckets must be cut for this server; None sends one tensor per broadcast."""
        return None if self.per_tensor else Layout.sglang(self.cfg.bucket_mb << 20)

    async def ranks(self) -> int:
        return 1

    async def data_plane(self) -> str:
        """The data plane this server takes (``transport``); a kind whose servers differ asks them."""
        return self.transport

    async def init_group(self, spec: GroupSpec) -> None:
        raise NotImplementedError

    async def destroy_group(self, group_name: str) -> None:
        raise NotImplementedError

    async def before(self, version: int) -> None:
        """Pause (a server that pauses ``before`` a version) and open the update session."""
        if self.api.weights.pause == "before":
            await self.control.pause(self.cfg.pause_mode)
        await self.request(self.api.weights.begin, json=self.begin_body(version))

    async def update(self, meta: BucketMeta) -> None:
        raise NotImplementedError

    async def after(self, version: int) -> None:
        """Close the session with ``version`` and resume generation.

        A server that pauses ``at_end`` stages while it generates and is paused only around ``end``, and
        only when running requests must be aborted at the switch (a pause mode that keeps them needs none).
        """
        at_end = self.api.weights.pause == "at_end"
        if at_end and not self.mode.keeps_requests and self.api.weights.end_aborts:
            await self.end(version, abort_running=True)  # the server pauses around the switch itself
            return
        if at_end and not self.mode.keeps_requests:
            await self.control.pause(self.cfg.pause_mode)
        try:
            await self.end(version)
        finally:
            if at_end and self.control.paused:
                await self.control.resume()
        if not at_end:
            await self.control.resume()

    def begin_body(self, version: int) -> dict:
        return {}

    async def end(self, version: int, *, abort_running: bool = False) -> None:
        """Switch to the staged version (``abort_running`` only where ``api.weights.end_aborts``)."""
        await self.request(self.api.weights.end, json={})

    async def recover(self, version: int) -> None:
        """After a failed push: leave the server serving (paused generation resumed)."""

    async def healthy(self) -> bool:
        try:
            resp = await self.http.get(
                f"{self.url}{self.api.health.path}", timeout=min(5.0, self.cfg.timeout_s)
            )
        except HTTPClientError:
            return False
        return resp.status_code == 200

    async def call(self, method: str, path: str, *, json: Any = None, params: Any = None) -> dict:
        """One control call; TransferError naming the server and path unless it answers success."""
        try:
            resp = await self.http.request(
                method, f"{self.url}{path}", json=json, params=params, timeout=self.cfg.timeout_s
            )
        except HTTPClientError as err:
            raise TransferError(f"{self.url}{path}: {err}") from err
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
            message = body.get("message") or body.get("error") if isinstance(body, dict) else None
            raise TransferError(f"{self.url}{path}: HTTP {resp.status_code}: {message or resp.text[:300]}")
        return body if isinstance(body, dict) else {"result": body}

    async def request(self, endpoint: Endpoint, *, json: Any = None, params: Any = None) -> dict:
        """:meth:`call` on an endpoint of the server's description."""
        return await self.call(endpoint.method, endpoint.path, json=json, params=params)

    async def _send(self, call: Call) -> dict:
        """Send a request the description built (the control's transport)."""
        return await self.call(call.method, call.path, json=call.json, params=dict(call.params) or None)


def _slipstream_layout(cfg: WeightSyncConfig) -> Layout:
    """Our receivers' exact layout. Large tensors travel from the trainer's memory as their own segments;
    the threshold is torch_dist's (see DIRECT_MIN_BYTES there)."""
    cap = cfg.bucket_mb << 20
    direct = 1 << 20 if resolve_device(cfg).type == "cuda" else cap // 2
    return Layout.slipstream(cap, direct_min_bytes=direct)


def _entries(meta: BucketMeta) -> tuple[list[str], list[str], list[list[int]]]:
    return (
        [e.name for e in meta.entries],
        [e.dtype for e in meta.entries],
        [list(e.shape) for e in meta.entries],
    )


@register_adapter("sglang")
class SGLangAdapter(ServerAdapter):
    """SGLang (``serverapi.SGLANG``; see the module docstring)."""

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
        names, dtypes, shapes = _entries(meta)
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


@register_adapter("embedded")
class EmbeddedAdapter(SGLangAdapter):
    """Our embedded server (``serverapi.EMBEDDED``): SGLang's sequence, staged (see the module docstring)."""

    api = EMBEDDED

    def __init__(self, url: str, cfg: WeightSyncConfig, http: HTTPClient) -> None:
        super().__init__(url, cfg, http)
        self.transport = "nixl" if cfg.backend == "nixl" else "dist"  # type: ignore[misc]

    def layout(self) -> Layout | None:
        return None if self.per_tensor else _slipstream_layout(self.cfg)

    async def ranks(self) -> int:
        return 1

    def init_extras(self) -> dict:
        return {"timeout_s": self.cfg.timeout_s}  # our receiver waits as long as we do

    def begin_body(self, version: int) -> dict:
        body: dict[str, Any] = {"weight_version": version}
        if self.transport in ("nixl", "ipc"):  # an ipc link sets "ipc" while it is open
            body["stream"] = self.transport
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


@register_adapter("vllm")
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

    api = VLLM
    transport = "dist"  # the slipstream engine's; :meth:`data_plane` reads each server's
    ENGINE_TRANSPORTS: ClassVar[dict[str, str]] = {"slipstream": "dist", "nccl": "nccl_uid"}

    def __init__(self, url: str, cfg: WeightSyncConfig, http: HTTPClient) -> None:
        super().__init__(url, cfg, http)
        self.engine: str | None = None  # the server's weight-transfer engine, once read
        self._session = False  # between a successful /start_weight_update and its /finish_weight_update
        self._loading = False  # an /update_weights of this session was sent: the layers may mix versions

    async def data_plane(self) -> str:
        if self.engine is None:
            info = await self.call("GET", "/server_info", params={"config_format": "json"})
            engine = ((info.get("vllm_config") or {}).get("weight_transfer_config") or {}).get("backend")
            self.engine = engine or "nccl"  # vLLM's default
        if self.engine not in self.ENGINE_TRANSPORTS:
            raise TransferError(
                f"{self.url}: vLLM runs the `{self.engine}` weight-transfer engine; Slipstream pushes to "
                f"{' or '.join(self.ENGINE_TRANSPORTS)} (rollout.vllm.weight_transfer)"
            )
        self.transport = self.ENGINE_TRANSPORTS[self.engine]  # type: ignore[misc]
        return self.transport

    @property
    def staged(self) -> bool:
        return self.engine != "nccl"

    def layout(self) -> Layout | None:
        if self.per_tensor:
            return None
        if self.staged:
            return _slipstream_layout(self.cfg)
        return Layout.vllm(self.cfg.bucket_mb << 20)

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

    async def before(self, version: int) -> None:
        """Pause, then open the update session; a session a previous trainer left open (it died mid-version)
        is closed first, without a version, since vLLM refuses a start while one is open."""
        try:
            await super().before(version)
        except TransferError as err:
            if "already active" not in str(err):
                raise
            log.warning("%s: closing a weight update left open by an earlier push", self.url)
            with contextlib.suppress(TransferError):
                await self.request(self.api.weights.end, json={})
            await self.request(self.api.weights.begin, json=self.begin_body(version))
        self._session, self._loading = True, False

    async def update(self, meta: BucketMeta) -> None:
        if not meta.entries:
            return
        names, dtypes, shapes = _entries(meta)
        if self.staged:
            update_info: dict[str, Any] = {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": self.group_name,
                "flush_cache": False,
            }
            if not self.per_tensor:
                update_info["slipstream_bucket"] = msgspec.to_builtins(meta)
        else:
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
