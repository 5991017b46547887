"""Server adapters: the exact HTTP sequence each kind of inference server needs to take a new version.

The publisher owns the data plane (a process group or NIXL) and calls an adapter per server for the control
plane. Per version, for every server at once:

  ``before(v)``  →  for each bucket: ``update(meta)`` (the blocking HTTP call, in flight while rank 0
  broadcasts the bucket)  →  ``after(v)``;  ``recover(v)`` after a failure (nothing is left paused).

Pinned versions and their sequences (research notes, inference_apis.md §A–B):

* ``sglang`` (SGLang 0.5.23): ``/pause_generation {mode}`` → ``/begin_weight_update {}`` → N ×
  ``/update_weights_from_distributed`` (``load_format: flattened_bucket``, one dtype per bucket,
  ``weight_version``, ``flush_cache`` false after an ``in_place`` pause since flushing fails while requests
  hold the cache) → ``/end_weight_update {}`` → ``/continue_generation {}``. Group: ``/init_weights_update_
  group``; worker ranks are ``rank_offset + tp_rank``, so a server counts ``tp_size`` ranks.
* ``vllm`` (vLLM 0.33, ``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=keep|abort`` → ``/start_weight_update`` →
  N × ``/update_weights {update_info: {names, dtype_names, shapes}}`` (each one packed broadcast whose
  boundaries vLLM re-derives from the names, hence the ``vllm`` bucket layout) → ``/finish_weight_update
  {weight_version}`` → ``/resume``. Group: ``/init_weight_transfer_engine`` with an NCCL unique id we mint
  (the torch-free rendezvous; no pickled store objects), ``packed: true`` and our bucket size.
* ``embedded`` (ours): SGLang's sequence, except that it stages: no pause before the transfer (it keeps
  generating), exact bucket layout in ``slipstream_bucket`` (chunks, mixed dtypes), and a pause only around
  ``/end_weight_update`` when in-flight requests must be aborted. With ``backend: nixl`` the version travels
  in-band (``/begin_weight_update {stream: "nixl"}``) and the per-bucket calls disappear.

To add a server kind: subclass :class:`ServerAdapter`, decorate it with ``@register_adapter("<kind>")``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx
import msgspec

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import resolve_device
from slipstream.weightsync.buckets import Layout
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.types import BucketMeta

log = get_logger(__name__)

ADAPTERS: dict[str, type[ServerAdapter]] = {}


def register_adapter(kind: str):
    def deco(cls: type[ServerAdapter]) -> type[ServerAdapter]:
        cls.kind = kind
        ADAPTERS[kind] = cls
        return cls

    return deco


def get_adapter_class(kind: str) -> type[ServerAdapter]:
    if kind not in ADAPTERS:
        raise ValueError(
            f"unknown server kind `{kind}` for weight sync (known: {', '.join(sorted(ADAPTERS))})"
        )
    return ADAPTERS[kind]


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
    ``nccl_uid`` (an NCCL communicator from a unique id) or ``nixl`` (in-band NIXL stream).
    """

    kind: ClassVar[str]
    transport: ClassVar[str] = "dist"

    def __init__(self, url: str, cfg: WeightSyncConfig, http: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.http = http
        self.per_tensor = cfg.backend == "naive"
        self.group_name = cfg.group_name  # the group of the push in progress (set by init_group)

    def layout(self) -> Layout | None:
        """How buckets must be cut for this server; None sends one tensor per broadcast."""
        return None if self.per_tensor else Layout.sglang(self.cfg.bucket_mb << 20)

    async def ranks(self) -> int:
        return 1

    async def init_group(self, spec: GroupSpec) -> None:
        raise NotImplementedError

    async def destroy_group(self, group_name: str) -> None:
        raise NotImplementedError

    async def before(self, version: int) -> None:
        raise NotImplementedError

    async def update(self, meta: BucketMeta) -> None:
        raise NotImplementedError

    async def after(self, version: int) -> None:
        raise NotImplementedError

    async def recover(self, version: int) -> None:
        """After a failed push: leave the server serving (paused generation resumed)."""

    async def healthy(self) -> bool:
        try:
            resp = await self.http.get(f"{self.url}/health", timeout=min(5.0, self.cfg.timeout_s))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def call(self, method: str, path: str, *, json: Any = None, params: Any = None) -> dict:
        """One control call; TransferError naming the server and path unless it answers success."""
        try:
            resp = await self.http.request(
                method, f"{self.url}{path}", json=json, params=params, timeout=self.cfg.timeout_s
            )
        except httpx.HTTPError as err:
            raise TransferError(f"{self.url}{path}: {type(err).__name__}: {err}") from err
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
            message = body.get("message") or body.get("error") if isinstance(body, dict) else None
            raise TransferError(f"{self.url}{path}: HTTP {resp.status_code}: {message or resp.text[:300]}")
        return body if isinstance(body, dict) else {"result": body}


def _entries(meta: BucketMeta) -> tuple[list[str], list[str], list[list[int]]]:
    return (
        [e.name for e in meta.entries],
        [e.dtype for e in meta.entries],
        [list(e.shape) for e in meta.entries],
    )


@register_adapter("sglang")
class SGLangAdapter(ServerAdapter):
    """SGLang 0.5.23 (see the module docstring)."""

    async def ranks(self) -> int:
        info = await self.call("GET", "/server_info")
        return int(info.get("tp_size", 1) or 1)

    async def init_group(self, spec: GroupSpec) -> None:
        self.group_name = spec.group_name
        await self.call(
            "POST",
            "/init_weights_update_group",
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
        await self.call("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    async def before(self, version: int) -> None:
        await self.call("POST", "/pause_generation", json={"mode": self.cfg.pause_mode})
        await self.call("POST", "/begin_weight_update", json={})

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
            "flush_cache": self.cfg.pause_mode != "in_place" and meta.last,
        }
        if not self.per_tensor:
            body["load_format"] = "flattened_bucket"
        return body

    async def update(self, meta: BucketMeta) -> None:
        if meta.entries:
            await self.call("POST", "/update_weights_from_distributed", json=self.update_body(meta))

    async def after(self, version: int) -> None:
        await self.call("POST", "/end_weight_update", json={})
        await self.call("POST", "/continue_generation", json={})

    async def recover(self, version: int) -> None:
        for path in ("/end_weight_update", "/continue_generation"):
            try:
                await self.call("POST", path, json={})
            except TransferError:
                pass


@register_adapter("embedded")
class EmbeddedAdapter(SGLangAdapter):
    """Our embedded server: SGLang's sequence, staged (see the module docstring)."""

    def __init__(self, url: str, cfg: WeightSyncConfig, http: httpx.AsyncClient) -> None:
        super().__init__(url, cfg, http)
        self.transport = "nixl" if cfg.backend == "nixl" else "dist"  # type: ignore[misc]
        self._paused = False

    def layout(self) -> Layout | None:
        # Large tensors travel from the trainer's memory as their own segments (our receiver takes them);
        # the threshold is torch_dist's (see DIRECT_MIN_BYTES there).
        cap = self.cfg.bucket_mb << 20
        direct = 1 << 20 if resolve_device(self.cfg).type == "cuda" else cap // 2
        return None if self.per_tensor else Layout.slipstream(cap, direct_min_bytes=direct)

    async def ranks(self) -> int:
        return 1

    def init_extras(self) -> dict:
        return {"timeout_s": self.cfg.timeout_s}  # our receiver waits as long as we do

    async def before(self, version: int) -> None:
        body: dict[str, Any] = {"weight_version": version}
        if self.transport in ("nixl", "ipc"):  # an ipc link sets "ipc" while it is open
            body["stream"] = self.transport
        await self.call("POST", "/begin_weight_update", json=body)

    def update_body(self, meta: BucketMeta) -> dict:
        body = super().update_body(meta)
        body["flush_cache"] = False
        if not self.per_tensor:
            body["slipstream_bucket"] = msgspec.to_builtins(meta)
        return body

    async def after(self, version: int) -> None:
        if self.cfg.pause_mode != "in_place":  # abort in-flight requests at the switch, not before
            await self.call("POST", "/pause_generation", json={"mode": "abort"})
            self._paused = True
        try:
            await self.call("POST", "/end_weight_update", json={"weight_version": version})
        finally:
            if self._paused:
                await self.call("POST", "/continue_generation", json={})
                self._paused = False

    async def recover(self, version: int) -> None:
        if self._paused:
            try:
                await self.call("POST", "/continue_generation", json={})
            except TransferError:
                pass
            self._paused = False

    async def nixl_prepare(self) -> bytes:
        try:
            resp = await self.http.post(f"{self.url}/weightsync/nixl/prepare", timeout=self.cfg.timeout_s)
        except httpx.HTTPError as err:
            raise TransferError(f"{self.url}/weightsync/nixl/prepare: {err}") from err
        if resp.status_code != 200:
            raise TransferError(
                f"{self.url}/weightsync/nixl/prepare: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        return resp.content

    async def nixl_connect(self, sender_json: dict, group_name: str) -> None:
        await self.call(
            "POST", "/weightsync/nixl/connect", json={"sender": sender_json, "group_name": group_name}
        )


VLLM_PAUSE = {"in_place": "keep", "abort": "abort", "retract": "abort"}


@register_adapter("vllm")
class VLLMAdapter(ServerAdapter):
    """vLLM 0.33 in dev mode with ``--weight-transfer-config '{"backend": "nccl"}'`` (module docstring)."""

    transport = "nccl_uid"

    def __init__(self, url: str, cfg: WeightSyncConfig, http: httpx.AsyncClient) -> None:
        super().__init__(url, cfg, http)
        self._session = False  # between a successful /start_weight_update and its /finish_weight_update
        self._loading = False  # an /update_weights of this session was sent: the layers may mix versions

    def layout(self) -> Layout | None:
        return None if self.per_tensor else Layout.vllm(self.cfg.bucket_mb << 20)

    async def ranks(self) -> int:
        resp = await self.call("GET", "/get_world_size", params={"include_dp": "true"})
        return int(resp.get("world_size", 1) or 1)

    async def init_group(self, spec: GroupSpec) -> None:
        await self.call(
            "POST",
            "/init_weight_transfer_engine",
            json={
                "init_info": {
                    "rank_offset": spec.rank_offset,
                    "world_size": spec.world_size,
                    "nccl_unique_id_b64": spec.nccl_unique_id_b64,
                    "packed": not self.per_tensor,
                    "packed_buffer_size_bytes": self.cfg.bucket_mb << 20,
                    "packed_num_buffers": 2,
                }
            },
        )

    async def destroy_group(self, group_name: str) -> None:
        await self.call("POST", "/shutdown_weight_transfer_engine", json={})

    async def before(self, version: int) -> None:
        params = {"mode": VLLM_PAUSE[self.cfg.pause_mode]}
        if params["mode"] == "abort":
            params["clear_cache"] = "true"
        await self.call("POST", "/pause", params=params)
        await self.call("POST", "/start_weight_update", json={})
        self._session, self._loading = True, False

    async def update(self, meta: BucketMeta) -> None:
        if meta.entries:
            names, dtypes, shapes = _entries(meta)
            update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
            self._loading = True
            await self.call("POST", "/update_weights", json={"update_info": update_info})

    async def after(self, version: int) -> None:
        await self.call("POST", "/finish_weight_update", json={"weight_version": str(version)})
        self._session = False
        await self.call("POST", "/resume")

    async def recover(self, version: int) -> None:
        """Close the update session, and resume only a server whose weights are whole.

        vLLM keeps the layers on the meta device from ``/start_weight_update`` until
        ``/finish_weight_update``, and refuses the next start while a session is open, so the session is
        always finished (without a version: the served version stays). A server that already received
        part of the version holds layers of two versions (a layer cut short holds uninitialised
        elements): it stays paused until a whole version arrives (the publisher's retry from its kept
        copy, or the next push), whose ``after`` resumes it.
        """
        if self._session:
            self._session = False
            try:  # vLLM may already have closed it (an update that failed inside vLLM resets the session)
                await self.call("POST", "/finish_weight_update", json={})
            except TransferError as err:
                log.debug("%s: closing the update session: %s", self.url, err)
        if self._loading:
            log.warning(
                "%s holds part of version %d; it stays paused until a whole version arrives",
                self.url,
                version,
            )
            return
        try:
            await self.call("POST", "/resume")
        except TransferError:
            pass
