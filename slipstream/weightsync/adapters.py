"""Server adapters: the HTTP sequence an inference server needs to take a new version (the generic base).

The publisher owns the data plane (a process group, an in-band stream) and calls an adapter per server for
the control plane. Per version, for every server at once:

  ``before(v, stream)``  →  for each bucket: ``update(meta)`` (the blocking HTTP call, in flight while rank 0
  broadcasts the bucket)  →  ``after(v)``;  ``recover(v)`` after a failure (nothing is left paused).

The endpoints, the pause modes and where the pause goes come from the server's description
(``slipstream.serverapi``: ``api.weights``, ``api.pause_modes``, which also pins the release); pause and
resume are sent by the adapter's :class:`~slipstream.serverapi.ServerControl`, the same object the
rollouter's clients use. What each kind adds (each request's body) is its :class:`ServerAdapter` subclass in
its module of ``slipstream.serverkinds`` (whose docstrings give the sequences; inference_apis.md §A–B).

Weight sync never looks a kind up by name: whoever chose the kind (the pipeline, a command, a test) hands the
publisher its record, which satisfies :class:`AdapterKind` (its adapter class and what its servers take).
To add a server kind: ``slipstream.serverkinds`` (its module docstring has the steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec

from slipstream.serverapi import Call, Endpoint, PauseMode, ServerAPI, ServerControl
from slipstream.utils.http_client import HTTPClient, HTTPClientError
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError

if TYPE_CHECKING:  # torch-free at import: the buckets and types are needed only when a version moves
    from slipstream.weightsync.base import TransportName
    from slipstream.weightsync.buckets import Layout
    from slipstream.weightsync.types import BucketMeta


class AdapterKind(Protocol):
    """What weight sync needs of a server kind, handed down by whoever chose it
    (``slipstream.serverkinds.ServerKind`` is one; the fields mean what they mean there)."""

    @property
    def name(self) -> str: ...
    @property
    def adapter(self) -> type[ServerAdapter]: ...
    @property
    def streams(self) -> tuple[str, ...]: ...
    @property
    def colocated_transports(self) -> tuple[str, ...]: ...
    @property
    def typed_buckets(self) -> bool: ...
    @property
    def rebuilds_send_less(self) -> bool: ...
    @property
    def send_less_missing(self) -> str: ...


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

    :meth:`data_plane` names the group transport the publisher must open when no stream is chosen
    (``torch_dist`` unless the server says otherwise). ``api`` is the server's description; ``mode`` how
    ``cfg.pause_mode`` reads on it (a mode it lacks is refused here, before any push).
    """

    kind: ClassVar[str]  # the kind's name (``rollout.backend``)
    api: ClassVar[ServerAPI]

    def __init__(self, url: str, cfg: WeightSyncConfig, http: HTTPClient) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.http = http
        self.per_tensor = cfg.backend == "naive"
        self.group_name = cfg.group_name  # the group of the push in progress (set by init_group)
        self.mode: PauseMode = self.api.pause_mode(cfg.pause_mode)
        self.control = ServerControl(self.api, self._send)

    @property
    def send_less_refusal(self) -> str:
        """Why this server cannot rebuild delta and LoRA-adapter versions under its own settings (vLLM's
        engine, read once linked); "" when it can or cannot tell yet. Whether its kind can at all is its
        record's ``rebuilds_send_less``, which the publisher checks first."""
        return ""

    def layout(self) -> Layout | None:
        """How buckets must be cut for this server; None sends one tensor per broadcast."""
        from slipstream.weightsync.buckets import Layout

        return None if self.per_tensor else Layout.sglang(self.cfg.bucket_mb << 20)

    @property
    def in_band(self) -> bool:
        """Whether this group member reads each bucket's metadata from the group itself once ``before``
        opened the version (torch_dist's store channel), so the buckets need no update call each."""
        return False

    async def ranks(self) -> int:
        return 1

    async def data_plane(self) -> TransportName:
        """The group transport this server takes; a kind whose servers differ asks them."""
        return "torch_dist"

    async def init_group(self, spec: GroupSpec) -> None:
        raise NotImplementedError

    async def destroy_group(self, group_name: str) -> None:
        raise NotImplementedError

    async def before(self, version: int, stream: TransportName | None = None) -> None:
        """Pause (a server that pauses ``before`` a version) and open the update session; ``stream``: the
        in-band stream the version travels in (the open link's), None for a group's announced buckets."""
        if self.api.weights.pause == "before":
            await self.control.pause(self.cfg.pause_mode)
        await self.request(self.api.weights.begin, json=self.begin_body(version, stream))

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

    def begin_body(self, version: int, stream: TransportName | None = None) -> dict:
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

    async def call(
        self, method: str, path: str, *, json: Any = None, params: Any = None, repeatable: bool = False
    ) -> dict:
        """One control call; TransferError naming the server and path unless it answers success."""
        try:
            resp = await self.http.request(
                method,
                f"{self.url}{path}",
                json=json,
                params=params,
                timeout=self.cfg.timeout_s,
                repeatable=repeatable,
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
        return await self.call(
            call.method,
            call.path,
            json=call.json,
            params=dict(call.params) or None,
            repeatable=call.repeatable,
        )


def slipstream_layout(cfg: WeightSyncConfig) -> Layout:
    """Our receivers' exact layout. Large tensors travel from the trainer's memory as their own segments;
    the threshold is torch_dist's (see DIRECT_MIN_BYTES there)."""
    from slipstream.weightsync.base import resolve_device
    from slipstream.weightsync.buckets import Layout

    cap = cfg.bucket_mb << 20
    direct = 1 << 20 if resolve_device(cfg).type == "cuda" else cap // 2
    return Layout.slipstream(cap, direct_min_bytes=direct)


def bucket_entries(meta: BucketMeta) -> tuple[list[str], list[str], list[list[int]]]:
    return (
        [e.name for e in meta.entries],
        [e.dtype for e in meta.entries],
        [list(e.shape) for e in meta.entries],
    )


__all__ = ["AdapterKind", "GroupSpec", "ServerAdapter", "bucket_entries", "slipstream_layout"]
