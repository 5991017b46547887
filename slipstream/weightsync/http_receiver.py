"""The receiving side of weight sync inside a serving process, behind SGLang's HTTP weight-update API.

A server mounts :func:`build_router` (``app.include_router(build_router(engine))``) and gets SGLang's
endpoints, so the trainer drives our embedded server and a real SGLang server with the same sequence:

  ``/init_weights_update_group``       join the trainer's process group (gloo on CPU, NCCL on GPU)
  ``/begin_weight_update``             start staging a version
  ``/update_weights_from_distributed`` receive one broadcast (``load_format: flattened_bucket``: one flat
                                       bucket; otherwise one broadcast per tensor) into staging memory
  ``/end_weight_update``               apply the staged version at once through ``WeightTarget``
                                       (``abort_running``: aborting what runs, under a pause of its own)
  ``/destroy_weights_update_group``    leave the group

The difference from SGLang, and the reason this module exists: a version is *staged*. Broadcasts land in
receive memory the receiver keeps (the model keeps serving meanwhile, since every blocking wait runs in a
worker thread), and only ``/end_weight_update`` touches the model, through ``WeightTarget.apply_weights``
(atomic under an in-place pause). A transfer cut short (a peer died, a timeout, a bad request) is
discarded and reported in ``GET /weightsync/status``; the old version keeps serving. A request this side
cannot take part in (so that the sender's broadcast would never be matched) closes the group, which makes
the sender fail at once instead of hanging.

A version that fails (cut short, refused by ``apply_weights``, superseded, abandoned by its trainer) frees the
memory it staged, whatever names it carried; a version older than the serving one is refused at
``/begin_weight_update`` (or its first bucket) before anything is staged. Joining a group gives up within
the request's ``timeout_s`` even when nothing listens at the master's address (groups.py), so a bad init
holds the weight lock no longer than it said.

These routes change what a server serves, so they must only be reachable with the server's token: the
embedded server's app guards them (``slipstream/rollouter/embedded/auth.py``); an app that mounts this
router elsewhere has to do the same.

Delta and LoRA versions (entries of kinds other than ``dense``, ``weightsync/send_less.py``) are rebuilt
into full HF-named tensors here, by the receiver's :class:`~slipstream.weightsync.send_less.Rebuilder`,
before ``apply_weights``, so every target (the embedded server, the vLLM plug-in) takes them unchanged; a
delta against a version this receiver does not hold is refused at its first bucket, naming both versions.

Underneath, the bytes move through the receiving ends of ``weightsync.base.Transport``: each joined group
is a ``torch_dist`` end that lands every announced bucket (``receive_bucket``), and the in-band streams
(``ipc``, ``nixl``) are ends whose whole version arrives by itself (``receive_weights``).

Extensions (ignored by nothing, since only our adapters send them): ``weight_version`` on begin/end,
``slipstream_bucket`` on updates (exact layout: aligned offsets, mixed dtypes, chunks), and the stream
mode, one route pair per in-band transport ``<name>`` (``ipc``, ``nixl``): ``POST /weightsync/<name>/
prepare`` returns this side's rendezvous, ``/weightsync/<name>/connect`` takes the sender's, and
``/begin_weight_update`` with ``stream: "<name>"`` receives the whole version in band while
``/end_weight_update`` waits for it and applies it.

Worked example (what the trainer's adapter sends, per version, after one ``init``)::

    POST /begin_weight_update {"weight_version": 7}
    POST /update_weights_from_distributed {"names": [...], "dtypes": [...], "shapes": [...],
         "group_name": "slipstream_weights", "load_format": "flattened_bucket", "weight_version": "7",
         "flush_cache": false}                            # × buckets, each while rank 0 broadcasts it
    POST /end_weight_update {"weight_version": 7}  ->  {"success": true, "weight_version": 7}
"""

from __future__ import annotations

import asyncio
import functools
import time
import traceback
from dataclasses import dataclass, field

import msgspec
import torch
from fastapi import APIRouter, Request, Response

from slipstream.utils.logging import get_logger
from slipstream.weightsync.base import Transport, make_transport
from slipstream.weightsync.buckets import BucketError, StagingArea, flattened_meta
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.send_less import Rebuilder, Rebuilt, SendLessError
from slipstream.weightsync.torch_dist import TorchDistTransport
from slipstream.weightsync.types import (
    DENSE,
    LORA_BASE,
    BeginWeightUpdateReq,
    BucketMeta,
    DestroyWeightsUpdateGroupReq,
    EndWeightUpdateReq,
    InitInfo,
    InitWeightsUpdateGroupReq,
    PausableTarget,
    PreparingTarget,
    ReceiverStatus,
    Rendezvous,
    StreamConnectReq,
    UpdateWeightsFromDistributedReq,
    VersionInfo,
    WeightTarget,
    WeightUpdateResp,
)

log = get_logger(__name__)

STREAMS = ("ipc", "nixl")  # transports whose versions arrive in band (``/begin_weight_update {stream}``)
# A joined torch_dist group can carry a whole version in band too (its buckets' metadata in the group's store):
# one begin call per version instead of one update call per bucket (vLLM's engine, ``rollouter/vllm_weights.py``).
GROUP_STREAM = "torch_dist"


class RequestError(ValueError):
    """A request that names something wrong (reported to the caller as success=false)."""


def parse_version(value: str | int | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise RequestError(f"weight_version must be an integer, got {value!r}") from None


@dataclass
class _Session:
    """One version being staged."""

    version: int | None
    staging: StagingArea | None = None
    next_index: int = 0
    error: str | None = None
    started: float = field(default_factory=time.perf_counter)
    active: float = field(default_factory=time.monotonic)
    receive_s: float = 0.0
    verify_s: float = 0.0  # checking the staged bytes against the sender's digests (``weightsync.verify``)
    stream_task: asyncio.Task | None = None
    # A version received in band, checked and rebuilt (and prepared, on a PreparingTarget) before its switch.
    prepared: Rebuilt | None = None


class WeightReceiver:
    """Stages weight versions for one :class:`WeightTarget` and applies each one whole.

    Invariants: at most one version is being staged; the target sees a version only through one
    ``apply_weights`` call, after every bucket of it arrived; weight operations run one at a time (an
    asyncio lock), while the event loop stays free to serve generation.
    """

    def __init__(self, target: WeightTarget, cfg: WeightSyncConfig | None = None) -> None:
        self.target = target
        self.cfg = cfg or WeightSyncConfig()
        # The torch_dist receiving end of each group this server joined, by group name.
        self.groups: dict[str, TorchDistTransport] = {}
        self.session: _Session | None = None
        self._staging: dict[str, StagingArea] = {}
        self._lock = asyncio.Lock()
        # In-band receiving ends (``ipc``, ``nixl``), once ``/weightsync/<name>/prepare`` ran.
        self.streams: dict[str, Transport] = {}
        self.applied_versions = 0
        self.failed_versions = 0
        self.last_error = ""
        self.last_apply_s = 0.0
        self.last_receive_s = 0.0
        self.last_verify_s = 0.0
        # How long any wait lasts: the trainer's limit once it has said so (init_weights_update_group).
        self.wait_s = self.cfg.timeout_s
        # What delta and LoRA versions are rebuilt from, before the target sees them (send_less.py).
        self.rebuilder = Rebuilder()

    # -- groups

    async def init_group(self, req: InitWeightsUpdateGroupReq) -> WeightUpdateResp:
        backend = req.backend if req.backend in ("gloo", "nccl") else ""
        if not backend:
            raise RequestError(f"backend `{req.backend}` is not supported here (use `gloo` or `nccl`)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError("backend `nccl` needs a GPU on this server; use `gloo`")
        if not 0 < req.rank_offset < req.world_size:
            raise RequestError(f"rank_offset {req.rank_offset} is outside a group of {req.world_size}")
        old = self.groups.pop(req.group_name, None)
        if old is not None:
            await asyncio.to_thread(old.close, 0)
        wait_s = req.timeout_s or self.cfg.timeout_s
        end = TorchDistTransport.for_backend(msgspec.structs.replace(self.cfg, timeout_s=wait_s), backend)
        info = InitInfo(
            backend=end.name,
            rank=req.rank_offset,
            world_size=req.world_size,
            group_name=req.group_name,
            address=req.master_address,
            port=req.master_port,
        )
        await asyncio.to_thread(end.connect, info)
        self.wait_s = wait_s
        self.groups[req.group_name] = end
        return WeightUpdateResp(success=True, message=f"joined `{req.group_name}` as rank {req.rank_offset}")

    async def destroy_group(self, req: DestroyWeightsUpdateGroupReq) -> WeightUpdateResp:
        group = self.groups.pop(req.group_name, None)
        if group is None:
            return WeightUpdateResp(success=False, message=f"no group `{req.group_name}`")
        # No barrier: the trainer side never joins one (SGLang's protocol has none), and gloo keeps an unmet
        # barrier running until the group's timeout, its destructor waiting for it with the event loop blocked.
        await asyncio.to_thread(group.close, 0)
        return WeightUpdateResp(success=True, message=f"left `{req.group_name}`")

    # -- versions

    async def begin(self, req: BeginWeightUpdateReq) -> WeightUpdateResp:
        version = parse_version(req.weight_version)
        self._check_newer(version)
        if self.session is not None:
            old = self.session
            self._fail(old, "superseded by a new begin_weight_update before it ended")
            self._end(old)
        session = _Session(version=version)
        self.session = session
        self._watch(session)
        if req.stream is not None:
            end = self._stream_end(req)
            end.min_version = self.target.weight_version  # refused at its first bucket
            session.stream_task = asyncio.create_task(self._receive_stream(session, end))
            session.stream_task.add_done_callback(lambda task: _stream_failed(self, session, task))
        return WeightUpdateResp(success=True, weight_version=session.version)

    async def update(self, req: UpdateWeightsFromDistributedReq) -> WeightUpdateResp:
        session = self.session
        group = self.groups.get(req.group_name)
        if session is None or session.stream_task is not None or group is None:
            why = (
                f"no group `{req.group_name}` (call /init_weights_update_group first)"
                if group is None
                else "must run between begin_weight_update() and end_weight_update()"
            )
            await self._close_group(req.group_name)  # the sender is broadcasting: make it fail, not hang
            raise RequestError(why)
        try:
            metas = self._metas(session, req)
        except (RequestError, BucketError) as err:
            await self._close_group(req.group_name)
            self._fail(session, str(err))
            self._release(session)  # the group is gone: nothing more can arrive for this version
            raise RequestError(str(err)) from err
        problem = self._check_specs(metas)
        start = time.perf_counter()
        for meta in metas:
            try:
                await asyncio.to_thread(group.receive_bucket, meta, session.staging)
            except (TransferError, BucketError) as err:
                await self._close_group(req.group_name)
                self._fail(session, f"bucket {meta.index}: {err}")
                self._release(session)
                raise TransferError(self.last_error) from err
            session.next_index = max(session.next_index, meta.index + 1)
        session.receive_s += time.perf_counter() - start
        session.active = time.monotonic()
        if problem:
            self._fail(session, problem)
            raise RequestError(problem)
        return WeightUpdateResp(success=True, weight_version=session.version)

    async def end(self, req: EndWeightUpdateReq) -> WeightUpdateResp:
        session = self.session
        if session is None:
            raise RequestError("no weight update in progress (call /begin_weight_update first)")
        version = parse_version(req.weight_version)
        paused = False
        try:
            if req.abort_running:
                if not isinstance(self.target, PausableTarget):
                    raise RequestError("this server cannot abort running requests at the switch")
                await self.target.pause("abort")
                paused = True
            return await self._apply(session, version)
        except Exception as err:
            self._fail(session, str(err) or type(err).__name__)  # no-op when already failed
            raise
        finally:
            self._end(session)  # applied or not, this version is over
            if paused:
                await self.target.resume()

    async def _apply(self, session: _Session, version: int | None) -> WeightUpdateResp:
        if session.stream_task is not None:
            try:
                await asyncio.wait_for(session.stream_task, self.wait_s)
            except (TransferError, RequestError, TimeoutError) as err:
                self._fail(session, f"stream: {err or 'timed out'}")  # a no-op for one that failed its checks
        if session.error is not None:
            raise TransferError(f"version {session.version} was discarded: {session.error}")
        if version is not None and session.version is not None and version != session.version:
            self._fail(session, f"end names version {version} but version {session.version} was staged")
            raise RequestError(self.last_error)
        version = session.version if session.version is not None else version
        rebuilt = session.prepared or await self._prepare(session, version)
        assert version is not None and session.staging is not None
        staged, session.prepared = rebuilt.tensors, None
        start = time.perf_counter()
        try:
            await asyncio.to_thread(self.target.apply_weights, staged, version)
        except Exception as err:
            self._fail(session, f"apply_weights refused version {version}: {err}")
            raise RequestError(self.last_error) from err
        self.last_apply_s = time.perf_counter() - start
        await asyncio.to_thread(self.rebuilder.applied, rebuilt, version)
        self.last_receive_s = session.receive_s
        staging = session.staging
        self.last_verify_s = staging.verify_s if isinstance(staging, StagingArea) else session.verify_s
        self.applied_versions += 1
        mb = session.staging.nbytes / 2**20
        msg = (
            f"applied version {version}: {len(staged)} tensors, {mb:.1f} MiB, apply {self.last_apply_s:.3f} s"
        )
        return WeightUpdateResp(success=True, message=msg, weight_version=version)

    async def _prepare(self, session: _Session, version: int | None) -> Rebuilt:
        """The version whole, checked and rebuilt into full tensors, and prepared on a :class:`PreparingTarget`
        (RequestError, the version failed, otherwise)."""
        problem = self._check_complete(session, version)
        if problem:
            self._fail(session, problem)
            raise RequestError(problem)
        assert version is not None and session.staging is not None
        try:  # delta and LoRA entries become full tensors here, so every target gets them (send_less.py)
            rebuilt = await asyncio.to_thread(self._rebuild, session.staging, version)
        except SendLessError as err:
            self._fail(session, str(err))
            raise RequestError(self.last_error) from err
        problem = self._check_all_weights(rebuilt, version)
        if problem:
            self._fail(session, problem)
            raise RequestError(problem)
        if isinstance(self.target, PreparingTarget):
            try:
                await asyncio.to_thread(self.target.prepare_weights, rebuilt.tensors, version)
            except Exception as err:
                self._fail(session, f"apply_weights refused version {version}: {err}")
                raise RequestError(self.last_error) from err
        return rebuilt

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(
            weight_version=self.target.weight_version,
            staging_version=self.session.version if self.session else None,
            groups=sorted(self.groups),
            applied_versions=self.applied_versions,
            failed_versions=self.failed_versions,
            last_error=self.last_error,
            last_apply_s=self.last_apply_s,
            last_receive_s=self.last_receive_s,
            last_verify_s=self.last_verify_s,
            delta_base=self.rebuilder.base_version,
            lora_base=len(self.rebuilder.lora_base),
            kept_bytes=self.rebuilder.kept_bytes,
        )

    def router(self) -> APIRouter:
        """The HTTP endpoints of this receiver (see the module docstring)."""
        return _router(self)

    def close(self) -> None:
        """Leave every group and release the in-band ends (call at server shutdown)."""
        for end in self.groups.values():
            end.close(barrier_timeout_s=0)
        self.groups.clear()
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()

    # -- in-band streams (``ipc`` on one host, ``nixl``): the whole version arrives over the transport

    async def stream_prepare(self, name: str) -> Rendezvous:
        """``/weightsync/<name>/prepare``: this server's receiving end of transport ``name``."""
        if name not in self.streams:
            self.streams[name] = make_transport(name, self.cfg, is_sender=False)
        return await asyncio.to_thread(self.streams[name].prepare)

    async def stream_connect(self, name: str, req: StreamConnectReq) -> WeightUpdateResp:
        """``/weightsync/<name>/connect``: join the sender whose rendezvous ``req`` carries."""
        end = self.streams.get(name)
        if end is None:
            raise RequestError(f"call /weightsync/{name}/prepare first")
        info = InitInfo(backend=name, rank=1, world_size=2, group_name=req.group_name, peers=[req.sender])
        await asyncio.to_thread(end.connect, info)
        return WeightUpdateResp(success=True, message=f"connected to the {name} sender")

    def _stream_end(self, req: BeginWeightUpdateReq) -> Transport:
        """The receiving end a version streams in on: a prepared ``ipc``/``nixl`` end, or a joined torch_dist
        group (``group_name``, or the group joined last) whose buckets carry their own metadata."""
        if req.stream == GROUP_STREAM:
            name = req.group_name
            if name is None and self.groups:
                name = next(reversed(self.groups))  # the group joined last: the sender's current link
            group = self.groups.get(name) if name is not None else None
            if group is None:
                joined = ", ".join(sorted(self.groups)) or "none"
                raise RequestError(f"stream `{GROUP_STREAM}` needs a joined group `{name}` (joined: {joined})")
            return group
        if req.stream not in STREAMS:
            raise RequestError(
                f"unknown stream `{req.stream}` (expected {', '.join((*STREAMS, GROUP_STREAM))} or none)"
            )
        end = self.streams.get(req.stream)
        if end is None:
            raise RequestError(f"stream `{req.stream}` needs /weightsync/{req.stream}/prepare and /connect first")
        return end

    def discard(self, reason: str) -> None:
        """Drop the version being staged, if any (the old one keeps serving); its in-band receive is cancelled."""
        session = self.session
        if session is None:
            return
        if session.stream_task is not None and not session.stream_task.done():
            session.stream_task.cancel()
        self._fail(session, reason)
        self._end(session)

    async def _receive_stream(self, session: _Session, end: Transport) -> None:
        start = time.perf_counter()
        stream = end.receive_weights()
        try:
            staged = await stream.collect()
            end.check_version(stream.version)  # ends that cannot refuse at the first bucket (torch_dist) refuse here
            if session.version is not None and stream.version != session.version:
                raise TransferError(f"received version {stream.version}, expected {session.version}")
            session.version = stream.version
            area = stream.staging
            parts, info = (dict(area.parts), area.info) if area is not None else ({}, None)
            session.staging = _Collected(staged, stream.nbytes, parts, info)
            session.receive_s = time.perf_counter() - start
            session.verify_s = area.verify_s if area is not None else 0.0
            # Whole: check, rebuild and prepare it now, while the old version still serves, so the switch only
            # switches (the target's prepare runs here; ``_apply`` prepares a version that arrived otherwise).
            session.prepared = await self._prepare(session, session.version)
        except (TransferError, RequestError, BucketError) as err:
            failure: tuple[type[Exception], str] | None = (type(err), str(err) or type(err).__name__)
        else:
            failure = None
        version = stream.version
        if failure is None:
            if isinstance(end, TorchDistTransport):
                await self._answer_group(end, version, "")
            return
        # Raised afresh, without the failure's traceback, whose frames hold the version's tensors: a refused
        # version's staging memory goes with its session.
        staged = stream = area = parts = info = None  # noqa: F841
        if isinstance(end, TorchDistTransport) and version is not None:
            await self._answer_group(end, version, failure[1])
            if session.staging is None:  # it left the version's broadcasts: make the sender fail, not hang
                await asyncio.to_thread(end.fail)
        raise failure[0](failure[1])

    async def _answer_group(self, end: TorchDistTransport, version: int, refusal: str) -> None:
        """Tell a group's sender the version is prepared (it then switches it in), or why it is refused."""
        try:
            await asyncio.to_thread(end.mark_prepared, version, refusal)
        except TransferError as err:
            log.debug("could not answer for version %d: %s", version, err)

    # -- helpers

    def _metas(self, session: _Session, req: UpdateWeightsFromDistributedReq) -> list[BucketMeta]:
        version = parse_version(req.weight_version)
        bucket = req.slipstream_bucket
        if bucket is not None:
            version = bucket.version if version is None else version
        if version is None:
            version = session.version
        if version is None:
            raise RequestError("no weight_version: give it on begin_weight_update or on each update")
        if session.version is None:
            self._check_newer(version)
            session.version = version
        elif version != session.version:
            raise RequestError(f"update for version {version} while staging version {session.version}")
        if session.staging is None:
            session.staging = self._staging_for(req.group_name)
            session.staging.begin(version)
        if bucket is not None:
            if bucket.version != version:
                raise RequestError(f"slipstream_bucket is for version {bucket.version}, not {version}")
            try:  # a delta against a version this receiver does not hold: refused before it is staged
                self.rebuilder.check_base(VersionInfo.of(bucket), version)
            except SendLessError as err:
                raise RequestError(str(err)) from None
            return [bucket]
        if req.load_format == "flattened_bucket":
            return [flattened_meta(req.names, req.dtypes, req.shapes, version, session.next_index)]
        if req.load_format not in (None, "auto"):
            raise RequestError(f"load_format `{req.load_format}` is not supported (use `flattened_bucket`)")
        return [
            flattened_meta([n], [d], [s], version, session.next_index + i)
            for i, (n, d, s) in enumerate(zip(req.names, req.dtypes, req.shapes, strict=False))
        ]

    def _staging_for(self, group_name: str) -> StagingArea:
        device = self.groups[group_name].device
        key = str(device)
        if key not in self._staging:
            self._staging[key] = StagingArea(device)
        return self._staging[key]

    def _check_specs(self, metas: list[BucketMeta]) -> str:
        """An early refusal for a tensor whose shape differs from the served one. Names the target does not
        list (tied aliases) and dtypes it casts are left to ``apply_weights``, which has the last word."""
        specs = self.target.weight_specs()
        for meta in metas:
            for entry in meta.entries:
                if entry.kind not in (DENSE, LORA_BASE):  # a delta's or an adapter's own shape
                    continue
                spec = specs.get(entry.name)
                if spec is not None and list(spec[0]) != list(entry.shape):
                    return f"`{entry.name}`: sent shape {list(entry.shape)}, serving {list(spec[0])}"
        return ""

    def _check_complete(self, session: _Session, version: int | None) -> str:
        if version is None:
            return "no weight_version was given for the staged update"
        if session.staging is None:
            return f"version {version}: nothing was received"
        if isinstance(session.staging, StagingArea) and session.staging.partial_names:
            return f"version {version}: tensors only partly received: {session.staging.partial_names}"
        return ""

    def _rebuild(self, staging: StagingArea | _Collected, version: int) -> Rebuilt:
        return self.rebuilder.rebuild(staging.staged, staging.parts, staging.info, version)

    def _check_all_weights(self, rebuilt: Rebuilt, version: int) -> str:
        """A version that must cover every served parameter (all but adapter-only LoRA versions) does."""
        if not self.cfg.require_all_weights or not rebuilt.complete:
            return ""
        missing = set(self.target.weight_specs()) - {name for name, _ in rebuilt.tensors}
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            return f"version {version} misses {len(missing)} parameters (e.g. {shown})"
        return ""

    def _watch(self, session: _Session) -> None:
        """Discard ``session`` if the trainer goes quiet for longer than it said it would ever wait."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if self.session is not session or session.stream_task is not None:
                return
            idle = time.monotonic() - session.active
            if idle < self.wait_s:
                loop.call_later(self.wait_s - idle + 0.1, check)
                return
            self._fail(session, f"no update for {idle:.0f} s: the trainer went away mid-version")
            self._end(session)

        loop.call_later(self.wait_s + 0.1, check)

    def _check_newer(self, version: int | None) -> None:
        """Refuse a version older than the serving one before a byte of it is staged."""
        serving = self.target.weight_version
        if version is not None and version < serving:
            raise RequestError(f"weight version {version} is older than the serving version {serving}")

    def _end(self, session: _Session) -> None:
        """``session`` is over: it is no longer current, and a failed one frees what it staged."""
        if self.session is session:
            self.session = None
        if session.error is not None:
            self._release(session)

    def _release(self, session: _Session) -> None:
        """Drop the staging memory of a failed version (the next version allocates afresh)."""
        staging, session.staging, session.prepared = session.staging, None, None
        for key, area in list(self._staging.items()):
            if area is staging:
                del self._staging[key]

    def _fail(self, session: _Session, reason: str) -> None:
        if session.error is None:
            session.error = reason
            self.failed_versions += 1
            self.last_error = f"version {session.version}: {reason}"
            log.warning("weight update discarded, old weights keep serving: %s", self.last_error)

    async def _close_group(self, name: str) -> None:
        end = self.groups.pop(name, None)
        if end is not None:
            await asyncio.to_thread(end.fail)


def _stream_failed(receiver: WeightReceiver, session: _Session, task: asyncio.Task) -> None:
    """Count a stream that failed when it failed (a dead trainer never calls /end_weight_update), and let
    go of what it staged: the error's traceback holds the frames that hold the staged tensors."""
    if not task.cancelled() and task.exception() is not None:
        receiver._fail(session, f"stream: {task.exception()}")
        traceback.clear_frames(task.exception().__traceback__)


@dataclass
class _Collected:
    """Staged tensors of a version received in-band (stream mode), shaped like a finished StagingArea."""

    staged: dict[str, torch.Tensor]
    nbytes: int
    parts: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    info: VersionInfo | None = None


# ------------------------------------------------------------------------------------------------ router


_JSON = "application/json"


def build_router(target: WeightTarget, cfg: WeightSyncConfig | None = None) -> APIRouter:
    """The weight-update endpoints for ``target``; the receiver is at ``router.weight_receiver``."""
    return WeightReceiver(target, cfg).router()


def _router(receiver: WeightReceiver) -> APIRouter:
    router = APIRouter()

    def endpoint(path: str, req_type: type | None, handler, method: str = "POST") -> None:
        async def handle(request: Request) -> Response:
            try:
                body = await request.body()
                args = [msgspec.json.decode(body or b"{}", type=req_type)] if req_type is not None else []
                async with receiver._lock:  # weight operations run one at a time, like SGLang's
                    result = await handler(*args)
                return Response(msgspec.json.encode(result), media_type=_JSON)
            except (msgspec.ValidationError, msgspec.DecodeError) as err:
                return _error(400, f"{path}: bad request body: {err}")
            except RequestError as err:
                return _error(400, str(err))
            except TransferError as err:
                return _error(500, str(err))

        router.add_api_route(path, handle, methods=[method])

    endpoint("/init_weights_update_group", InitWeightsUpdateGroupReq, receiver.init_group)
    endpoint("/destroy_weights_update_group", DestroyWeightsUpdateGroupReq, receiver.destroy_group)
    endpoint("/begin_weight_update", BeginWeightUpdateReq, receiver.begin)
    endpoint("/update_weights_from_distributed", UpdateWeightsFromDistributedReq, receiver.update)
    endpoint("/end_weight_update", EndWeightUpdateReq, receiver.end)
    router.add_api_route("/weightsync/status", _status(receiver), methods=["GET"])
    for name in STREAMS:
        endpoint(f"/weightsync/{name}/prepare", None, functools.partial(receiver.stream_prepare, name))
        endpoint(
            f"/weightsync/{name}/connect", StreamConnectReq, functools.partial(receiver.stream_connect, name)
        )
    router.weight_receiver = receiver  # type: ignore[attr-defined]
    return router


def _status(receiver: WeightReceiver):
    async def status() -> Response:  # never waits for the weight lock: it must answer mid-transfer
        return Response(msgspec.json.encode(receiver.status()), media_type=_JSON)

    return status


def _error(status: int, message: str) -> Response:
    return Response(
        msgspec.json.encode(WeightUpdateResp(success=False, message=message)), status, media_type=_JSON
    )
