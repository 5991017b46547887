"""A transport opened with a set of HTTP inference servers: which one, how they join it, how a version moves.

The sending end is a :class:`~slipstream.weightsync.base.Transport`, the same class benches and tests drive;
what this module adds is the servers' half of the rendezvous, made through their HTTP APIs (each server's
:class:`~slipstream.weightsync.adapters.ServerAdapter`). Two ways to join, decided by the transport:

* a *group* (``torch_dist``, ``nccl_uid``): each server joins through its adapter's ``init_group``
  (SGLang's ``/init_weights_update_group``, vLLM's ``/init_weight_transfer_engine``) while rank 0 joins
  here, concurrently, since both block until everyone has arrived. Every bucket's metadata is announced
  out of band by the adapters' blocking ``update`` calls, in the server's own bucket layout, or, for
  servers that read it from the group (``ServerAdapter.in_band``: vLLM's ``slipstream`` engine), sent in
  band beside the bytes, without a call per bucket;
* a *stream* (``ipc``, ``nixl``; our embedded server): each server prepares its receiving end
  (``POST /weightsync/<name>/prepare``, its :class:`Rendezvous`) and connects to ours (``/connect``); the
  whole version then travels in band (``/begin_weight_update {stream: <name>}``), without per-bucket calls.

:func:`choose_transport` is the one selector: ``weightsync.backend``, where ``auto`` picks ``ipc`` for
servers of a kind that takes it on a shared GPU (its record's ``colocated_transports``: the embedded server)
that all share this host (and this GPU, for a GPU sender), and the servers' own group transport otherwise
(their adapters' ``data_plane``); ``naive`` is ``torch_dist`` with one tensor per bucket (the adapters cut
them). Which way servers join is the transport's ``joins``, and whether buckets must be typed for them its
``type_buckets`` hook: nothing here branches on a transport's name. The kind comes from the caller (an
:class:`~slipstream.weightsync.adapters.AdapterKind`), never looked up by name.

Worked example (what the publisher does)::

    name = await choose_transport(cfg, kind, adapters, device)
    link = await ServerLink.open(name, adapters, cfg, device, group_name="slipstream_weights",
                                 typed_buckets=kind.typed_buckets)
    stats = await link.push(adapters, named_tensors, version)   # between the adapters' before(v, link.stream)
    await link.close(adapters)                                  # and after(v)
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable, Sequence

import msgspec
import torch

from slipstream.utils.logging import get_logger
from slipstream.weightsync.adapters import AdapterKind, GroupSpec, ServerAdapter
from slipstream.weightsync.base import (
    TRANSPORTS,
    SendStats,
    Transport,
    TransportName,
    build_topology,
    make_transport,
)
from slipstream.weightsync.buckets import BufferPool
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.groups import backend_for_device
from slipstream.weightsync.torch_dist import TorchDistTransport
from slipstream.weightsync.types import BucketMeta, Rendezvous, VersionInfo

log = get_logger(__name__)


def stream_named(backend: str) -> TransportName | None:
    """The transport ``weightsync.backend`` names when servers join it as a stream (``ipc``, ``nixl``); None
    for a group transport, ``auto`` or ``naive``."""
    if backend in TRANSPORTS and (cls := TRANSPORTS.get(backend)).joins == "stream":
        return cls.name
    return None


async def choose_transport(
    cfg: WeightSyncConfig, kind: AdapterKind, adapters: Sequence[ServerAdapter], device
) -> TransportName:
    """The transport for a push to ``adapters``, servers of ``kind`` (module docstring)."""
    if (stream := stream_named(cfg.backend)) is not None:
        return stream
    if cfg.backend == "auto" and adapters and "ipc" in kind.colocated_transports:
        if await colocated(adapters, device):  # the one transport that shares a GPU (NCCL refuses to)
            return "ipc"
    planes = set(await asyncio.gather(*(a.data_plane() for a in adapters))) if adapters else set()
    if len(planes) > 1:
        raise TransferError(f"the servers take different data planes ({', '.join(sorted(planes))})")
    return planes.pop() if planes else "torch_dist"


async def colocated(adapters: Sequence[ServerAdapter], device) -> bool:
    """Whether every server runs on this host and, for a GPU ``device``, on the same physical GPU."""
    from slipstream.weightsync.ipc_memory import colocated as pair
    from slipstream.weightsync.ipc_memory import device_identity, host_identity

    me = Rendezvous(backend="ipc", host=host_identity(), device=device_identity(torch.device(device)))
    try:
        receivers = await _stream_receivers(adapters, "ipc")
    except (TransferError, msgspec.ValidationError, msgspec.DecodeError) as err:
        log.info("weightsync.backend auto: no ipc (%s)", err)
        return False
    return all(pair(me, r) for r in receivers)


class ServerLink:
    """The sending end of one transport, joined by a fixed set of servers (adding or losing one means a
    new link). ``stream``: the transport's name while its servers receive in band, each version's begin
    asks for it (``adapter.before(version, link.stream)``); None for a group (module docstring)."""

    def __init__(self, transport: Transport, group_name: str) -> None:
        self.transport = transport
        self.group_name = group_name
        self.stream: TransportName | None = transport.name if transport.joins == "stream" else None
        self.failed = False

    @property
    def streamed(self) -> bool:
        return self.stream is not None

    @classmethod
    async def open(
        cls,
        name: TransportName,
        adapters: Sequence[ServerAdapter],
        cfg: WeightSyncConfig,
        device,
        group_name: str,
        pool: BufferPool | None = None,
        *,
        typed_buckets: bool = False,
    ) -> ServerLink:
        """Open transport ``name`` and have every server join it, the way the transport ``joins``;
        ``typed_buckets``: the servers build each bucket as one typed tensor (their kind's record: SGLang).
        TransferError naming who failed."""
        transport = make_transport(name, cfg, is_sender=True, device=device)
        if transport.joins == "stream":
            await _join_stream(transport, adapters, group_name)
            return cls(transport, group_name)
        if pool is not None:
            transport.pool = pool  # the publisher's buffers, kept from one link to the next
        transport.type_buckets(typed_buckets)
        await _join_group(transport, adapters, group_name)
        return cls(transport, group_name)

    async def push(
        self,
        adapters: Sequence[ServerAdapter],
        named_tensors: Iterable,
        version: int,
        info: VersionInfo | None = None,
    ) -> SendStats:
        """Send one version to ``adapters`` (the link's servers), between their ``before`` and ``after``;
        ``info``: the send-less fields of its buckets (``send_less.py``)."""
        if self.streamed:
            return await self.transport.send_weights(named_tensors, version, info=info)
        layout = adapters[0].layout()  # None: one tensor per bucket (``naive``)
        if all(a.in_band for a in adapters):  # group members that read the metadata beside the bytes
            return await self._push_in_band(named_tensors, version, layout, info)

        async def announce(meta: BucketMeta) -> None:
            await _all(adapters, lambda a: a.update(meta))

        return await self.transport.send_weights(
            named_tensors, version, layout=layout, announce=announce, info=info
        )

    async def _push_in_band(self, named_tensors: Iterable, version: int, layout, info) -> SendStats:
        """Send a version to group members that read its metadata from the group, then wait until each has
        prepared it, so their switch is only a switch. A failure names what a receiver refused, if it did."""
        transport = self.transport
        assert isinstance(transport, TorchDistTransport)
        try:
            stats = await transport.send_weights(named_tensors, version, layout=layout, info=info)
            await asyncio.to_thread(transport.wait_prepared, version)
        except TransferError as err:
            refused = await asyncio.to_thread(transport.refusals, version)
            if refused and not str(err).startswith(f"version {version} refused"):
                raise TransferError(f"{err}; refused: {'; '.join(refused)}") from err
            raise
        return stats

    def fail(self) -> None:
        """Tear the transport down at once (peers blocked in a receive then fail instead of waiting)."""
        self.failed = True
        self.transport.fail()

    async def close(self, adapters: Iterable[ServerAdapter]) -> None:
        if self.streamed:
            await asyncio.to_thread(self.transport.close)
            return
        # No barrier: every broadcast was answered by the servers' update calls before a link is closed,
        # and SGLang's destroy never joins one (a barrier would stall, then abort the communicator).
        calls = [a.destroy_group(self.group_name) for a in adapters] if not self.failed else []
        results = await asyncio.gather(asyncio.to_thread(self._close_quietly), *calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("leaving group %s: %s", self.group_name, r)

    def _close_quietly(self) -> None:
        self.transport.leave_servers()


# ------------------------------------------------------------------------------------------------ joining


async def _join_group(transport: Transport, adapters: Sequence[ServerAdapter], group_name: str) -> None:
    """Rank 0 joins here while every server joins through its adapter; a server counts its worker ranks."""
    sender = await asyncio.to_thread(transport.prepare)
    try:
        ranks = await asyncio.gather(*(a.ranks() for a in adapters))
    except BaseException:
        transport.close()  # the store's listening socket, reserved by prepare
        raise
    receivers = [Rendezvous(backend=sender.backend, ranks=n) for n in ranks]
    info, infos = build_topology(sender, receivers, group_name)
    uid = base64.b64encode(sender.nccl_unique_id).decode() if sender.nccl_unique_id else ""
    backend = "nccl" if uid else backend_for_device(transport.device)
    specs = [
        GroupSpec(
            master_address=i.address,
            master_port=i.port,
            rank_offset=i.rank,
            world_size=i.world_size,
            group_name=group_name,
            backend=backend,
            nccl_unique_id_b64=uid,
        )
        for i in infos
    ]
    calls = [asyncio.create_task(a.init_group(s)) for a, s in zip(adapters, specs, strict=True)]
    local = asyncio.create_task(asyncio.to_thread(transport.connect, info))
    results = await asyncio.gather(local, *calls, return_exceptions=True)
    _raise_join_errors(transport, adapters, results, "the weight group")


async def _join_stream(transport: Transport, adapters: Sequence[ServerAdapter], group_name: str) -> None:
    """Every server prepares its receiving end and connects to ours, while ours accepts them."""
    try:
        sender = await asyncio.to_thread(transport.prepare)
        receivers = await _stream_receivers(adapters, transport.name)
        info, _ = build_topology(sender, receivers, group_name)
        body = {"sender": msgspec.to_builtins(sender), "group_name": group_name}
        calls = [
            asyncio.create_task(
                a.call("POST", a.api.weights.stream_connect.format(stream=transport.name), json=body)
            )
            for a in adapters
        ]
        local = asyncio.create_task(asyncio.to_thread(transport.connect, info))
        done, _ = await asyncio.wait([local, *calls], return_when=asyncio.FIRST_EXCEPTION)
        if any(t.exception() is not None for t in done):
            transport.close()  # wakes an ipc sender's accept, so nobody waits for the timeout
        results = await asyncio.gather(local, *calls, return_exceptions=True)
        _raise_join_errors(transport, adapters, results, f"the {transport.name} link")
    except BaseException:
        transport.close()
        raise


async def _stream_receivers(adapters: Sequence[ServerAdapter], name: str) -> list[Rendezvous]:
    bodies = await asyncio.gather(
        *(a.call("POST", a.api.weights.stream_prepare.format(stream=name)) for a in adapters)
    )
    # Through JSON bytes, not ``convert``: byte fields (NIXL's agent metadata) travel as base64 text.
    return [msgspec.json.decode(msgspec.json.encode(body), type=Rendezvous) for body in bodies]


def _raise_join_errors(
    transport: Transport, adapters: Sequence[ServerAdapter], results: list, what: str
) -> None:
    errors = [
        f"{a.url}: {r}" for a, r in zip(adapters, results[1:], strict=True) if isinstance(r, BaseException)
    ]
    if isinstance(results[0], BaseException):
        errors.insert(0, f"trainer side: {results[0]}")
    if errors:
        try:
            transport.fail()  # a half-built group has little to release; its peers may never arrive
        except Exception as err:
            log.debug("closing a half-built %s: %s", what, err)
        raise TransferError(f"could not build {what}: " + "; ".join(errors))


async def _all(adapters: Sequence[ServerAdapter], call) -> None:
    results = await asyncio.gather(*(call(a) for a in adapters), return_exceptions=True)
    errors = [f"{a.url}: {r}" for a, r in zip(adapters, results, strict=True) if isinstance(r, BaseException)]
    if errors:
        raise TransferError("; ".join(errors))
