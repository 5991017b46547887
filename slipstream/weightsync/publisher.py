"""The trainer's side of weight sync: push every new version to every inference server.

:class:`WeightPublisher` is what the pipeline wires into the trainer's publish hook (on rank 0; the other
ranks only iterate, see :func:`make_publish_fn`). For each version it runs, for all servers at once, the
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

    pub = WeightPublisher(cfg.weightsync, ["http://127.0.0.1:30001", "http://127.0.0.1:30002"], "embedded")
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
from slipstream.weightsync.adapters import ServerAdapter, get_adapter_class
from slipstream.weightsync.base import resolve_device
from slipstream.weightsync.buckets import BufferPool
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import SourceFailed, TransferError
from slipstream.weightsync.servers import ServerLink, choose_transport

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
    retried: bool = False


class Snapshot:
    """A CPU copy of the last published version, recorded while the trainer's tensors stream past.

    ``version`` is None while a recording is under way or after one was cut short (its tensors then mix
    two versions and must not be sent). Buffers are reused from one version to the next.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def record(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Iterator:
        self.version = None
        fresh: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            buf = self.tensors.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buf.copy_(tensor.detach())
            fresh[name] = buf
            yield name, tensor
        self.tensors = fresh
        self.version = version

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())


class WeightPublisher:
    """Pushes versions from trainer rank 0 to a set of servers of one kind (module docstring).

    The public methods are synchronous and thread-safe; the work runs on a private event loop thread.
    """

    def __init__(
        self, cfg: WeightSyncConfig, server_urls: list[str], server_kind: str, *, token: str | None = None
    ) -> None:
        self.cfg = cfg
        # The servers' control token, sent on every call (None: $SLIPSTREAM_SERVER_TOKEN; "": none).
        self._token = env_token() if token is None else token
        self.kind = server_kind
        self._adapter_cls = get_adapter_class(server_kind)
        if cfg.backend in ("nixl", "ipc") and server_kind != "embedded":
            raise ValueError(
                f"weightsync.backend `{cfg.backend}` works with embedded servers only, not `{server_kind}`"
            )
        self.device = resolve_device(cfg)
        self.pool = BufferPool(self.device)
        self.snapshot = Snapshot() if cfg.keep_last else None
        self.servers: dict[str, ServerAdapter] = {}
        self.down: dict[str, str] = {}
        self._link: ServerLink | None = None
        self._link_members: list[str] = []
        self._joins = 0
        self._builds = 0
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
        """Push ``version`` to every live server; returns once each has applied it or failed."""
        with self._lock:
            return self._run(self._publish(version, named_tensors))

    def add_server(self, url: str) -> PublishReport | None:
        """Add a server (or a restarted one); it gets the last published version now, if there is one."""
        url = url.rstrip("/")
        with self._lock:
            self.servers[url] = self._adapter(url)
            self.down.pop(url, None)
            return self._run(self._catch_up([url]))

    def remove_server(self, url: str) -> None:
        url = url.rstrip("/")
        with self._lock:
            self.servers.pop(url, None)
            self.down.pop(url, None)
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
        return self._adapter_cls(url, self.cfg, self._http[url])

    async def _publish(self, version: int, named_tensors: Iterable) -> PublishReport:
        source: Iterable = self.snapshot.record(named_tensors, version) if self.snapshot else named_tensors
        source = iter(source)
        report = PublishReport(version=version)
        await self._revive()
        try:
            members = await self._ensure_link(report)
            if members:
                await self._push(members, version, source, report)
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
                await self._push(members, version, iter(self.snapshot.items()), report)
        except TransferError as err:
            await self._after_failure(version, str(err), report)
            await self._probe(report)
        return report

    async def _push(self, members: list[str], version: int, source: Iterator, report: PublishReport) -> None:
        adapters = [self.servers[u] for u in members]
        link = self._link
        start = time.perf_counter()
        try:
            await _all(adapters, lambda a: a.before(version))
            stats = await link.push(adapters, source, version)
            await _all(adapters, lambda a: a.after(version))
        except BaseException:  # whatever failed, no server is left paused with its update session open
            await asyncio.gather(*(a.recover(version) for a in adapters), return_exceptions=True)
            raise
        report.ok = members
        report.bytes, report.buckets = stats.bytes, stats.buckets
        report.seconds = time.perf_counter() - start

    async def _ensure_link(self, report: PublishReport) -> list[str]:
        members = self._live()
        if self._link is not None and members == self._link_members:
            return members
        await self._drop_link()
        if not members:
            return []
        adapters = [self.servers[u] for u in members]
        transport = await choose_transport(self.cfg, self._adapter_cls, adapters, self.device)
        # Every rebuild gets a fresh group name: a server that could not leave the old group (it was
        # stuck in a broadcast when the link failed) must not refuse the new one for its name.
        name = self.cfg.group_name if not self._builds else f"{self.cfg.group_name}-{self._builds}"
        self._builds += 1
        self._link = await ServerLink.open(transport, adapters, self.cfg, self.device, name, self.pool)
        self._link_members = members
        return members

    async def _drop_link(self) -> None:
        if self._link is not None:
            link, members = self._link, [self.servers[u] for u in self._link_members if u in self.servers]
            self._link, self._link_members = None, []
            await link.close(members)

    async def _after_failure(self, version: int, reason: str, report: PublishReport) -> None:
        """Tear the link down at once, then have its servers leave their side of it (bounded, best effort):
        a server that keeps a group it was in can never join another of that name (SGLang)."""
        log.warning("weight push of version %d failed: %s", version, reason)
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
        transport = await choose_transport(self.cfg, self._adapter_cls, adapters, self.device)
        saved = self._link, self._link_members
        try:
            self._link = await ServerLink.open(transport, adapters, self.cfg, self.device, name, self.pool)
            self._link_members = urls
            await self._push(urls, version, iter(self.snapshot.items()), report)
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


def make_publish_fn(publisher: WeightPublisher | None) -> Callable[[int, Iterable], None]:
    """The trainer's publish hook: rank 0 passes its publisher; every other rank passes None and only
    iterates (the iterator runs the collectives that gather full tensors on all ranks)."""

    def publish(version: int, named_tensors: Iterable) -> None:
        if publisher is None:
            _drain(iter(named_tensors))
            return
        report = publisher.publish(version, named_tensors)
        if report.failed:
            log.warning(
                "version %d reached %d of %d servers", version, len(report.ok), len(publisher.servers)
            )

    return publish
