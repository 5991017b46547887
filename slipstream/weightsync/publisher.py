"""The trainer's side of weight sync: push every new version to every inference server.

:class:`WeightPublisher` is what rank 0's trainer pushes through (``Trainer.push``: the other ranks only
iterate, see :func:`publish_whole` and :func:`publish_lora`). For each version it runs, for all servers at once, the
adapter's control sequence around a transport (:mod:`~slipstream.weightsync.servers`: a
:class:`~slipstream.weightsync.base.Transport` the servers joined), packing bucket *i+1* in a worker thread
while bucket *i* is on the wire and the servers' blocking HTTP calls are in flight (the deadlock rule: a
server's receive call returns only once rank 0 has broadcast).

Membership and failures:
  * the link (the transport with its servers) is built for the current set of healthy servers and rebuilt
    when that set changes;
  * a server added later (``add_server``, e.g. a restarted replica) first gets the last published version
    over a link of its own, from the CPU copy kept with ``keep_last``; the next push includes it;
  * a push that fails (a server died, a timeout) tears the link down at once, probes every server, marks
    the dead ones down (they rejoin when they answer ``/health`` again) and, with ``keep_last``, retries
    the version once for the live ones. The trainer's iterator is always consumed to the end, so the
    collectives other trainer ranks run inside it never hang. Embedded servers discard a cut-short version
    and keep serving the old one.

Worked example::

    kind = server_kind("embedded")   # the caller's choice (slipstream.serverkinds), handed down
    pub = WeightPublisher(cfg.weightsync, ["http://127.0.0.1:30001", "http://127.0.0.1:30002"], kind)
    report = pub.publish(7, engine.get_per_tensor_param())
    report.ok        # ['http://127.0.0.1:30001', 'http://127.0.0.1:30002']
    pub.add_server("http://127.0.0.1:30003")   # gets version 7 at once
    pub.close()
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import msgspec
import torch

from slipstream.utils.http_auth import env_token
from slipstream.utils.http_client import HTTPClient
from slipstream.utils.logging import get_logger
from slipstream.weightsync.adapters import AdapterKind, ServerAdapter
from slipstream.weightsync.base import TransportName, resolve_device
from slipstream.weightsync.buckets import VERIFY_FAILED, BufferPool
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import SourceFailed, TransferError
from slipstream.weightsync.send_less import DeltaStats, delta_entries, lora_items
from slipstream.weightsync.servers import ServerLink, choose_transport, stream_named
from slipstream.weightsync.types import DENSE, VersionInfo

log = get_logger(__name__)

LEAVE_TIMEOUT_S = 10.0  # how long a server gets to leave a failed link's group


class PublishReport(msgspec.Struct, kw_only=True):
    """The outcome of one push: which servers now serve ``version`` and why the others do not."""

    version: int
    ok: list[str] = []
    failed: dict[str, str] = {}
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    # Of ``seconds``, the buckets on their way (packing pipelined with the wire), without the servers' calls,
    # their preparation of the version or its switch.
    send_s: float = 0.0
    # Of ``send_s``, digesting the tensors for verification (``weightsync.verify``; the receivers' checks are
    # their own: ``last_verify_s`` in their status).
    verify_s: float = 0.0
    retried: bool = False
    # What travelled: ``full``, ``delta`` (against version ``base``), ``lora`` (base weights and adapters),
    # ``adapters`` (adapters only) or ``merged`` (a LoRA version as whole weights, W + scale B A); for a
    # delta, the fraction of elements that changed and the dense bytes the version would have taken.
    sent: str = "full"
    base: int = -1
    changed_fraction: float = 0.0
    dense_bytes: int = 0
    # The longest any server was paused by this push (it generated nothing then): the whole transfer for a
    # server that pauses before it, the switch alone for one that stages while it generates.
    paused_s: float = 0.0
    # Attempts a server refused because a tensor's staged bytes failed verification (``weightsync.verify``):
    # each means corruption between this trainer and that server (a retry from the kept copy may still land).
    verify_failed: int = 0


class Snapshot:
    """A CPU copy of the last published version, recorded while the trainer's tensors stream past.

    ``version`` is None while a recording is under way or after one was cut short (its tensors then mix
    two versions and must not be sent). Buffers are reused from one version to the next. Each tensor keeps
    its entry kind (``dense``, or for LoRA ``lora_base``/``lora_A``/``lora_B``), so :meth:`items` is always
    a whole version: an adapter-only recording (``partial``) replaces the adapters and keeps the base.

    ``encode(name, tensor, previous)`` (a delta push) turns each tensor into the entries that go on the
    wire, computed before ``previous`` (this tensor's buffer, the last version) is overwritten.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}
        self.lora_scale = 0.0

    def record(
        self,
        items: Iterable[tuple],
        version: int,
        *,
        encode: Callable[[str, torch.Tensor, torch.Tensor | None], list[tuple]] | None = None,
        partial: bool = False,
        lora_scale: float = 0.0,
    ) -> Iterator:
        complete = self.version is not None
        self.version = None
        fresh: dict[str, torch.Tensor] = dict(self.tensors) if partial else {}
        kinds: dict[str, str] = dict(self.kinds) if partial else {}
        for item in items:
            name, tensor = item[0], item[1]
            kind = item[2] if len(item) > 2 else DENSE
            buf = self.tensors.get(name)
            out = encode(name, tensor, buf) if encode is not None else [item]
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buf.copy_(tensor.detach())
            fresh[name], kinds[name] = buf, kind
            yield from out
        self.tensors, self.kinds, self.lora_scale = fresh, kinds, lora_scale
        if complete or not partial:  # an adapter-only recording over no base is no whole version
            self.version = version

    def items(self) -> list[tuple[str, torch.Tensor, str]]:
        return [(name, t, self.kinds.get(name, DENSE)) for name, t in self.tensors.items()]


class WholeNames:
    """The parameter names of the last whole version published: a later whole version that lacks one is a
    sender's bug, refused (``ValueError`` naming them) at the end of its stream, before any server switches
    to it. Our receivers refuse such a version themselves; SGLang's loads each bucket as it comes and would
    serve the missing tensor from the older version."""

    def __init__(self) -> None:
        self.names: frozenset[str] | None = None

    def check(self, items: Iterable[tuple], version: int) -> Iterator[tuple]:
        seen: set[str] = set()
        for item in items:
            seen.add(item[0])
            yield item
        missing = self.names - seen if self.names is not None else set()
        if missing:
            listed = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(
                f"version {version} misses {len(missing)} parameters of the last whole version ({listed}): "
                "refused whole, the servers keep serving the one they have"
            )
        self.names = frozenset(seen)


class WeightPublisher:
    """Pushes versions from trainer rank 0 to a set of servers of one kind (module docstring).

    ``kind``: the servers' kind as its caller chose it (``slipstream.serverkinds.server_kind(name)``; any
    :class:`~slipstream.weightsync.adapters.AdapterKind`). The public methods are synchronous and
    thread-safe; the work runs on a private event loop thread.
    """

    def __init__(
        self, cfg: WeightSyncConfig, server_urls: list[str], kind: AdapterKind, *, token: str | None = None
    ) -> None:
        self.cfg = cfg
        # The servers' control token, sent on every call (None: $SLIPSTREAM_SERVER_TOKEN; "": none).
        self._token = env_token() if token is None else token
        self.kind = kind.name
        self._record = kind
        if stream_named(cfg.backend) is not None and cfg.backend not in kind.streams:
            takes = f"takes {' or '.join(kind.streams)}" if kind.streams else "takes none"
            raise ValueError(
                f"weightsync.backend `{cfg.backend}` is an in-band stream `{kind.name}` servers do not take "
                f"(their kind {takes})"
            )
        if cfg.delta:
            _check_send_less(cfg, self._record, "weightsync.delta")
        self.device = resolve_device(cfg)
        self.pool = BufferPool(self.device)
        # A delta is computed against the last version sent, so delta pushes keep it whatever keep_last says.
        self.snapshot = Snapshot() if cfg.keep_last or cfg.delta else None
        self.whole_names = WholeNames()
        self.servers: dict[str, ServerAdapter] = {}
        # The version each server applied last, when this publisher saw it do so (dropped at any failure,
        # join or revival): a delta goes only to servers all on the previous version, an adapter-only
        # LoRA version only to servers that hold a LoRA version's base weights.
        self.held: dict[str, int] = {}
        self.down: dict[str, str] = {}
        self._link: ServerLink | None = None
        self._link_members: list[str] = []
        self._joins = 0
        self._builds = 0
        self._lora_how = ""  # how LoRA versions last travelled (logged when it changes)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-publisher", daemon=True)
        self._thread.start()
        # One HTTP client per server: a shared pool is scanned whole on every call (O(servers) per call,
        # O(servers^2) per push) and, at a pool's connection limit, queues calls and reconnects servers.
        self._http: dict[str, HTTPClient] = {}
        for url in server_urls:
            self.servers[url.rstrip("/")] = self._adapter(url)

    # -- public API

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Push ``version`` to every live server; returns once each has applied it or failed.

        With ``weightsync.delta`` it travels as a delta against the previous version when every server
        holds that version (``send_less.py``), else whole; either way each server then serves exactly
        ``named_tensors``."""
        with self._lock:
            return self._run(self._publish(version, named_tensors))

    def needs_full(self) -> bool:
        """Whether the next LoRA version must carry the base weights: a live server has not applied a LoRA
        version from this publisher (it is new, restarted, or failed its last push). Rank 0 asks this
        before the trainer gathers anything, and every rank follows its answer."""
        with self._lock:
            return any(u not in self.held for u in self._live())

    def lora_push(self) -> str:
        """How the next LoRA version travels: ``merged`` (whole weights, ``W + lora_scale B A``) when a live
        server cannot rebuild adapter versions (its kind, or vLLM's own ``nccl`` engine, read from the
        server), else ``lora`` (adapters and base weights: :meth:`needs_full`) or ``adapters``. Logged
        once, and again if it changes."""
        with self._lock:
            refusals = self._run(self._send_less_refusals())
        how = "merged" if refusals else "adapters"
        if how != self._lora_how:
            self._lora_how = how
            if refusals:
                why = "; ".join(f"{url}: {reason}" for url, reason in refusals.items())
                log.info("LoRA versions go as merged whole weights (W + scale B A): %s", why)
            else:
                log.info("LoRA versions go as adapters (with the base weights to a server that lacks them)")
        if refusals:
            return "merged"
        return "lora" if self.needs_full() else "adapters"

    def publish_merged(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishReport:
        """Push a LoRA version as whole merged weights (:meth:`lora_push` said ``merged``): a full version,
        after which no server holds LoRA base weights, so a later adapter version carries them again."""
        report = self.publish(version, named_tensors)
        report.sent = "merged"
        with self._lock:
            self.held.clear()
        return report

    def publish_lora(
        self,
        version: int,
        adapters: Iterable[tuple[str, torch.Tensor]],
        base: Iterable[tuple[str, torch.Tensor]] | None,
        lora_scale: float,
    ) -> PublishReport:
        """Push a LoRA version: the adapters (``<module>.lora_A.weight``/``lora_B.weight``) and, when
        ``base`` is given, every base weight (``needs_full``); servers serve ``W + lora_scale B A``."""
        _check_send_less(self.cfg, self._record, "LoRA adapter pushes")
        if base is None and self.needs_full():
            _drain(iter(adapters))
            raise TransferError(
                f"version {version}: adapter-only push, but servers {[u for u in self._live() if u not in self.held]}"
                " hold no LoRA base weights from this publisher: push the base weights (needs_full())"
            )
        with self._lock:
            return self._run(self._publish_lora(version, adapters, base, lora_scale))

    def add_server(self, url: str) -> PublishReport | None:
        """Add a server (or a restarted one); it gets the last published version now, if there is one."""
        url = url.rstrip("/")
        with self._lock:
            self.servers[url] = self._adapter(url)
            self.down.pop(url, None)
            self.held.pop(url, None)
            return self._run(self._catch_up([url]))

    def remove_server(self, url: str) -> None:
        url = url.rstrip("/")
        with self._lock:
            self.servers.pop(url, None)
            self.down.pop(url, None)
            self.held.pop(url, None)
            client = self._http.pop(url, None)
            if client is not None:
                self._run(client.aclose())

    def close(self) -> None:
        with self._lock:
            if self._loop.is_closed():
                return
            self._run(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    # -- the event-loop side

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _adapter(self, url: str) -> ServerAdapter:
        url = url.rstrip("/")
        old = self._http.pop(url, None)
        if old is not None:
            self._run(old.aclose())
        self._http[url] = HTTPClient(token=self._token, timeout_s=self.cfg.timeout_s)
        return self._record.adapter(url, self.cfg, self._http[url])

    async def _publish(self, version: int, named_tensors: Iterable) -> PublishReport:
        previous = self.snapshot.version if self.snapshot is not None else None
        stats, base = DeltaStats(), [-1]  # the base is chosen once the link's members are known

        def encode(name: str, tensor: torch.Tensor, prev: torch.Tensor | None) -> list[tuple]:
            return delta_entries(name, tensor, prev, stats) if base[0] >= 0 else [(name, tensor)]

        source: Iterable = self.whole_names.check(named_tensors, version)
        if self.snapshot is not None:
            source = self.snapshot.record(source, version, encode=encode if self.cfg.delta else None)
        return await self._publish_source(version, iter(source), base, previous, stats)

    async def _publish_lora(
        self, version: int, adapters: Iterable, base: Iterable | None, scale: float
    ) -> PublishReport:
        items = lora_items(adapters, base)
        source: Iterable = items
        if self.snapshot is not None:
            source = self.snapshot.record(items, version, partial=base is None, lora_scale=scale)
        report = await self._publish_source(
            version,
            iter(source),
            [-1],
            None,
            None,
            VersionInfo(lora_scale=scale),
            "lora" if base else "adapters",
        )
        return report

    async def _publish_source(
        self,
        version: int,
        source: Iterator,
        base: list[int],
        previous: int | None,
        stats: DeltaStats | None,
        info: VersionInfo | None = None,
        sent: str = "full",
    ) -> PublishReport:
        report = PublishReport(version=version, sent=sent)
        await self._revive()
        try:
            members = await self._ensure_link(report)
            if members:
                if self.cfg.delta or sent != "full":  # the servers' engines are known once linked
                    _check_receivers([self.servers[u] for u in members])
                if info is None:
                    delta = (
                        self.cfg.delta
                        and previous is not None
                        and all(self.held.get(u) == previous for u in members)
                    )
                    base[0] = previous if delta and previous is not None else -1
                    info = VersionInfo(base=base[0], keep=self.cfg.delta)
                    report.sent, report.base = ("delta", base[0]) if delta else ("full", -1)
                await self._push(members, version, source, report, info)
                if stats is not None and base[0] >= 0:
                    report.changed_fraction, report.dense_bytes = stats.changed_fraction, stats.dense_bytes
                return report
        except SourceFailed as failed:  # not the wire (a packing error, out of memory): recover, then raise
            err = failed.__cause__ or failed
            await self._after_failure(version, f"{type(err).__name__}: {err}", report)
            raise err from None
        except TransferError as err:
            await self._after_failure(version, str(err), report)
        except Exception as err:  # the same, raised outside the transport
            await self._after_failure(version, f"{type(err).__name__}: {err}", report)
            raise
        finally:
            await asyncio.to_thread(_drain, source)  # other trainer ranks run collectives inside it
        await self._probe(report)
        if self.snapshot is not None and self.snapshot.version == version and self._live():
            return await self._retry(version, report)
        return report

    async def _retry(self, version: int, report: PublishReport) -> PublishReport:
        report.retried = True
        try:
            members = await self._ensure_link(report)
            if members:
                report.failed = {u: r for u, r in report.failed.items() if u not in members}
                report.sent, report.base = ("lora" if self.snapshot.lora_scale else "full"), -1
                await self._push(members, version, iter(self.snapshot.items()), report, self._whole_info())
        except TransferError as err:
            await self._after_failure(version, str(err), report)
            await self._probe(report)
        return report

    def _whole_info(self) -> VersionInfo:
        """The send-less fields of a whole version sent from the snapshot (a retry, a catch-up)."""
        assert self.snapshot is not None
        return VersionInfo(keep=self.cfg.delta, lora_scale=self.snapshot.lora_scale)

    async def _push(
        self, members: list[str], version: int, source: Iterator, report: PublishReport, info: VersionInfo
    ) -> None:
        adapters = [self.servers[u] for u in members]
        link = self._link
        start = time.perf_counter()
        paused = [a.control.paused_s for a in adapters]
        for url in members:  # known again only once it applied this version
            self.held.pop(url, None)
        try:
            await _all(adapters, lambda a: a.before(version, link.stream))
            stats = await link.push(adapters, source, version, info)
            await _all(adapters, lambda a: a.after(version))
        except BaseException:  # whatever failed, no server is left paused with its update session open
            await asyncio.gather(*(a.recover(version) for a in adapters), return_exceptions=True)
            raise
        finally:
            pauses = [a.control.paused_s - before for a, before in zip(adapters, paused, strict=True)]
            report.paused_s = max(report.paused_s, *pauses)
        report.ok = members
        for url in members:
            self.held[url] = version
        report.bytes, report.buckets, report.send_s = stats.bytes, stats.buckets, stats.seconds
        report.verify_s = stats.digest_s
        report.seconds = time.perf_counter() - start

    async def _ensure_link(self, report: PublishReport) -> list[str]:
        members = self._live()
        if self._link is not None and members == self._link_members:
            return members
        await self._drop_link()
        if not members:
            return []
        adapters = [self.servers[u] for u in members]
        transport = await choose_transport(self.cfg, self._record, adapters, self.device)
        # Every rebuild gets a fresh group name: a server that could not leave the old group (it was
        # stuck in a broadcast when the link failed) must not refuse the new one for its name.
        name = self.cfg.group_name if not self._builds else f"{self.cfg.group_name}-{self._builds}"
        self._builds += 1
        self._link = await self._open_link(transport, adapters, name)
        self._link_members = members
        return members

    async def _open_link(
        self, transport: TransportName, adapters: list[ServerAdapter], name: str
    ) -> ServerLink:
        return await ServerLink.open(
            transport,
            adapters,
            self.cfg,
            self.device,
            name,
            self.pool,
            typed_buckets=self._record.typed_buckets,
        )

    async def _drop_link(self) -> None:
        if self._link is not None:
            link, members = self._link, [self.servers[u] for u in self._link_members if u in self.servers]
            self._link, self._link_members = None, []
            await link.close(members)

    async def _after_failure(self, version: int, reason: str, report: PublishReport) -> None:
        """Tear the link down at once, then have its servers leave their side of it (bounded, best effort):
        a server that keeps a group it was in can never join another of that name (SGLang)."""
        log.warning("weight push of version %d failed: %s", version, reason)
        if VERIFY_FAILED in reason:
            report.verify_failed += 1
        for url in self._link_members or self._live():
            report.failed.setdefault(url, reason)
        report.ok = []
        link, members = self._link, [self.servers[u] for u in self._link_members if u in self.servers]
        self._link, self._link_members = None, []
        if link is None:
            return
        try:
            link.fail()
        except Exception as err:
            log.debug("tearing the link down: %s", err)
        await _leave(members, link.group_name, min(LEAVE_TIMEOUT_S, self.cfg.timeout_s))

    async def _probe(self, report: PublishReport) -> None:
        alive = await asyncio.gather(*(self.servers[u].healthy() for u in self._live()))
        for url, ok in zip(self._live(), alive, strict=True):
            if not ok:
                self.down[url] = report.failed.get(url, "not healthy")
                log.warning("server %s is down; it rejoins when /health answers again", url)

    async def _revive(self) -> None:
        back = [u for u in list(self.down) if u in self.servers and await self.servers[u].healthy()]
        for url in back:
            del self.down[url]
            self.held.pop(url, None)  # it may have restarted: whole versions until it applies one

    async def _send_less_refusals(self) -> dict[str, str]:
        """Why each live server cannot rebuild send-less versions (none: every one can). A kind that can
        under some setting is asked per server (``data_plane`` reads vLLM's engine; a server that does not
        answer is left to the push)."""
        if not self._record.rebuilds_send_less:
            return {f"`{self.kind}` servers": self._record.send_less_missing}
        adapters = [self.servers[u] for u in self._live()]
        await asyncio.gather(*(a.data_plane() for a in adapters), return_exceptions=True)
        return {a.url: a.send_less_refusal for a in adapters if a.send_less_refusal}

    def _live(self) -> list[str]:
        return [u for u in self.servers if u not in self.down]

    async def _catch_up(self, urls: list[str]) -> PublishReport | None:
        if self.snapshot is None or self.snapshot.version is None:
            return None
        version = self.snapshot.version
        report = PublishReport(version=version)
        adapters = [self.servers[u] for u in urls]
        self._joins += 1
        name = f"{self.cfg.group_name}-join{self._joins}"
        transport = await choose_transport(self.cfg, self._record, adapters, self.device)
        saved = self._link, self._link_members
        try:
            self._link = await self._open_link(transport, adapters, name)
            self._link_members = urls
            report.sent = "lora" if self.snapshot.lora_scale else "full"
            await self._push(urls, version, iter(self.snapshot.items()), report, self._whole_info())
            await self._link.close(adapters)
        except TransferError as err:
            await self._after_failure(version, str(err), report)
        finally:
            self._link, self._link_members = saved  # the next publish rebuilds it with the newcomers
        return report

    async def _shutdown(self) -> None:
        try:
            await self._drop_link()
        finally:
            await asyncio.gather(*(c.aclose() for c in self._http.values()), return_exceptions=True)
            self._http.clear()


def _check_send_less(cfg: WeightSyncConfig, kind: AdapterKind, what: str) -> None:
    """Delta and LoRA versions need receivers that rebuild them (the record's ``rebuilds_send_less``; which
    servers do under their settings is checked once they are linked) and bucket metadata that carry each
    entry's kind (not the per-tensor ``naive`` calls, which name dense tensors only). The config check
    (``pipeline/modes.py``) names the kinds that can."""
    if not kind.rebuilds_send_less:
        raise ValueError(
            f"{what}: `{kind.name}` servers cannot rebuild weights from them ({kind.send_less_missing})"
        )
    if cfg.backend == "naive":
        raise ValueError(
            f"{what}: weightsync.backend `naive` sends no entry kinds; use torch_dist, ipc or nixl"
        )


def _check_receivers(adapters: list[ServerAdapter]) -> None:
    """Every server of a delta or LoRA-adapter version must rebuild it (a vLLM server must run our
    weight-transfer engine, read once it is linked): refused before a byte moves."""
    bad = {a.url: a.send_less_refusal for a in adapters if a.send_less_refusal}
    if bad:
        why = "; ".join(f"{url}: {reason}" for url, reason in bad.items())
        raise ValueError(f"delta and LoRA versions need servers that rebuild them; {why}")


async def _all(adapters: list[ServerAdapter], call: Callable) -> None:
    results = await asyncio.gather(*(call(a) for a in adapters), return_exceptions=True)
    errors = [f"{a.url}: {r}" for a, r in zip(adapters, results, strict=True) if isinstance(r, BaseException)]
    if errors:
        raise TransferError("; ".join(errors))


async def _leave(adapters: list[ServerAdapter], group_name: str, timeout_s: float) -> None:
    async def one(adapter: ServerAdapter) -> None:
        try:
            await asyncio.wait_for(adapter.destroy_group(group_name), timeout_s)
        except (TransferError, TimeoutError) as err:  # a dead server has nothing left to leave
            log.debug("%s: leaving group %s: %s", adapter.url, group_name, err)

    await asyncio.gather(*(one(a) for a in adapters))


def _drain(source: Iterator) -> None:
    for _ in source:
        pass


LORA_PUSHES = ("adapters", "lora", "merged")  # what :meth:`WeightPublisher.lora_push` answers, by code


def publish_lora(
    publisher: WeightPublisher | None,
    version: int,
    adapters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    base: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    lora_scale: float,
    agree: Callable[[int], int] = lambda code: code,
    merged: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> PublishReport | None:
    """The trainer's LoRA push, run on every rank: rank 0 (``publisher``) decides how the version travels
    (:meth:`WeightPublisher.lora_push`: the adapters alone, with the base weights, or whole merged weights
    to servers that cannot rebuild adapters), ``agree`` gives every rank rank 0's answer as its index in
    :data:`LORA_PUSHES` (a broadcast; the identity on one rank), and every rank gathers the same tensors in
    the same order: ``merged()`` (the engine's merged model), or the adapters and then, when needed, the
    base weights. Ranks other than 0 pass None and only iterate."""
    how = LORA_PUSHES[int(agree(LORA_PUSHES.index(publisher.lora_push()) if publisher is not None else 0))]
    if how == "merged":
        if merged is None:
            raise ValueError(
                f"version {version}: the servers cannot rebuild LoRA adapter versions, and no merged weights "
                "were given to push instead"
            )
        if publisher is None:
            _drain(iter(merged()))
            return None
        report = publisher.publish_merged(version, merged())
    else:
        base_items = base() if how == "lora" else None
        if publisher is None:
            _drain(lora_items(adapters(), base_items))
            return None
        report = publisher.publish_lora(version, adapters(), base_items, lora_scale)
    if report.failed:
        log.warning("version %d reached %d of %d servers", version, len(report.ok), len(publisher.servers))
    return report


def publish_whole(
    publisher: WeightPublisher | None, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> PublishReport | None:
    """The trainer's whole-weights push, run on every rank: rank 0 passes its publisher; every other rank
    passes None and only iterates (the iterator runs the collectives that gather full tensors on all ranks)."""
    if publisher is None:
        _drain(iter(named_tensors))
        return None
    report = publisher.publish(version, named_tensors)
    if report.failed:
        log.warning("version %d reached %d of %d servers", version, len(report.ok), len(publisher.servers))
    return report
