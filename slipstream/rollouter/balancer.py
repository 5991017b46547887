"""Spread generate requests over N inference servers; survive a server dying.

Policy, in order:

1. **Sticky sessions**: a request with a ``session_id`` goes to the server that served that session before
   (multi-turn episodes reuse the prompt's KV cache there), waiting for capacity on it if needed.
2. **Least outstanding requests** for everything else, ties broken round-robin, never more than
   ``max_concurrent_per_server`` in flight on one server (the others wait).
3. **Failover**: when a server cannot be reached or the connection breaks mid-request
   (:class:`ServerUnavailable`), it is marked dead and the request is re-sent from scratch to another live
   server; its sessions move too. A request that exceeds ``request_timeout_s`` is aborted there and
   retried elsewhere. ``GenerateOutput.server`` says where a request finished. Nothing is dropped: a
   request fails only when no live server is left or ``max_attempts`` are used up.

Why not SGLang's router (smg): it balances only SGLang servers, does not route the pause and weight-update
calls (design.md §3 needs those per server anyway), and moves no request when a worker dies mid-flight.

Pausing is not the balancer's job: weight sync pauses and resumes each server around a version
(``weightsync/adapters.py``, through ``slipstream.serverapi.ServerControl``); the balancer only aborts.

Worked example::

    lb = LoadBalancer([make_client(kind, u) for u in urls], max_concurrent_per_server=64)  # kind: the caller's
    out = await lb.generate(prompt_ids, SamplingParams(max_new_tokens=64), rid="p3-1", session_id="p3-1")
    out.server          # "http://127.0.0.1:30001"
    lb.outstanding()    # {"http://127.0.0.1:30000": 12, "http://127.0.0.1:30001": 11}
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.rollouter.clients import ClientKind, client_for
from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.config import RolloutConfig
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Sessions remembered for stickiness (least recently used forgotten first).
_MAX_SESSIONS = 100_000


class NoServerAvailable(RuntimeError):
    """Every server is marked dead (or none was added)."""


class LoadBalancer:
    """An :class:`~slipstream.agents.protocol.InferenceClient` over several :class:`ServerClient`.

    Invariants: ``outstanding()[url]`` counts requests handed to ``url`` and not yet returned, and never
    exceeds ``max_concurrent_per_server``; a dead server gets no new requests until :meth:`add` or
    :meth:`check_health` brings it back. All methods run on one event loop.
    """

    def __init__(
        self,
        clients: Iterable[ServerClient],
        *,
        max_concurrent_per_server: int,
        request_timeout_s: float | None = None,
        max_attempts: int | None = None,
    ) -> None:
        if max_concurrent_per_server < 1:
            raise ValueError(f"max_concurrent_per_server must be at least 1, got {max_concurrent_per_server}")
        self.max_concurrent_per_server = max_concurrent_per_server
        self.request_timeout_s = request_timeout_s
        self._max_attempts = max_attempts
        self._clients: dict[str, ServerClient] = {}
        self._alive: set[str] = set()
        self._outstanding: dict[str, int] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._where: dict[str, str] = {}
        self._rr = 0
        self._ring_cache: list[str] | None = None
        self._changed = asyncio.Event()
        for client in clients:
            self.add(client)

    # ------------------------------------------------------------------ pool

    def add(self, client: ServerClient) -> None:
        """Add a server (or bring a dead one back, replacing its client)."""
        url = client.base_url
        self._clients[url] = client
        self._alive.add(url)
        self._outstanding.setdefault(url, 0)
        self._ring_cache = None
        self._changed.set()

    def remove(self, base_url: str) -> ServerClient | None:
        """Take a server out of the pool; returns its client (the caller closes it). In-flight requests end
        normally."""
        self._alive.discard(base_url)
        self._ring_cache = None
        self._changed.set()
        return self._clients.pop(base_url, None)

    def mark_dead(self, base_url: str) -> None:
        if base_url in self._alive:
            log.warning("inference server %s marked dead; its requests move to other servers", base_url)
        self._alive.discard(base_url)
        self._ring_cache = None
        self._changed.set()

    def alive(self) -> list[str]:
        return list(self._ring())

    def outstanding(self) -> dict[str, int]:
        return {url: self._outstanding.get(url, 0) for url in self._clients}

    @property
    def clients(self) -> list[ServerClient]:
        return list(self._clients.values())

    async def check_health(self) -> dict[str, bool]:
        """Probe every server: healthy ones are (again) alive, the others are marked dead."""
        urls = list(self._clients)
        results = await asyncio.gather(*(self._clients[u].health() for u in urls))
        for url, ok in zip(urls, results, strict=True):
            if ok:
                self._alive.add(url)
            else:
                self.mark_dead(url)
        self._ring_cache = None
        self._changed.set()
        return dict(zip(urls, results, strict=True))

    # ------------------------------------------------------------------ InferenceClient

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        **media: Any,
    ) -> GenerateOutput:
        rid = rid or uuid.uuid4().hex
        max_attempts = self._max_attempts or 2 * max(1, len(self._clients)) + 1
        tried: set[str] = set()
        for attempt in range(1, max_attempts + 1):
            url = await self._acquire(session_id, exclude=tried)
            self._where[rid] = url
            try:
                out = await self._generate_on(url, input_ids, sampling, rid, session_id, media)
            except ServerUnavailable as err:
                self.mark_dead(url)
                tried.add(url)
                log.warning(
                    "request %s failed on %s (%s); attempt %d/%d",
                    rid,
                    url,
                    err.message,
                    attempt,
                    max_attempts,
                )
            except TimeoutError:
                tried.add(url)
                log.warning(
                    "request %s timed out on %s after %.0f s; retrying", rid, url, self.request_timeout_s
                )
                await self._abort_quietly(url, rid)
            else:
                out.server = url
                return out
            finally:
                self._release(url)
                if self._where.get(rid) == url:
                    del self._where[rid]
        raise NoServerAvailable(
            f"request {rid} failed on every attempt ({max_attempts}); servers tried: {tried}"
        )

    async def _generate_on(self, url, input_ids, sampling, rid, session_id, media) -> GenerateOutput:
        # media: a request's images (``images=``), passed on only when it has some
        coro = self._clients[url].generate(input_ids, sampling, rid=rid, session_id=session_id, **media)
        if self.request_timeout_s is None:
            return await coro
        return await asyncio.wait_for(coro, self.request_timeout_s)

    async def abort(self, rid: str) -> None:
        url = self._where.get(rid)
        if url is not None and url in self._clients:
            await self._abort_quietly(url, rid)

    async def abort_all(self) -> None:
        await self._each_alive(lambda c: c.abort_all())

    async def weight_versions(self) -> dict[str, int]:
        urls = self.alive()
        versions = await asyncio.gather(*(self._clients[u].weight_version() for u in urls))
        return dict(zip(urls, versions, strict=True))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()), return_exceptions=True)

    # ------------------------------------------------------------------ internals

    def _pick(self, session_id: str | None, exclude: set[str]) -> str | None:
        """The server for the next request, or None when every candidate is at capacity.

        One pass over the live servers, starting one further round the ring at each call, keeping the first
        with the fewest outstanding requests (so ties go round-robin); it stops early at an idle server. This
        runs for every request, so it does O(1) work per server: no list is rebuilt or searched inside it.
        """
        ring = self._ring()
        if not ring:
            raise NoServerAvailable("no live inference server (every server is marked dead)")
        # Excluded servers (already tried by this request) are used only when nothing else is left.
        skip = exclude if exclude and any(u not in exclude for u in ring) else ()
        cap = self.max_concurrent_per_server
        sticky = self._sticky.get(session_id) if session_id is not None else None
        if sticky is not None and sticky in self._alive and sticky not in skip:
            return sticky if self._outstanding[sticky] < cap else None
        n = len(ring)
        self._rr += 1
        start = self._rr % n
        best, best_load = None, cap
        outstanding = self._outstanding
        for k in range(n):
            url = ring[(start + k) % n]
            load = outstanding[url]
            if load < best_load and url not in skip:
                best, best_load = url, load
                if load == 0:
                    break
        return best

    def _ring(self) -> list[str]:
        """Live servers in the order they were added (cached: rebuilt only when the pool changes)."""
        if self._ring_cache is None:
            self._ring_cache = [url for url in self._clients if url in self._alive]
        return self._ring_cache

    async def _acquire(self, session_id: str | None, exclude: set[str]) -> str:
        while True:
            url = self._pick(session_id, exclude)
            if url is not None:
                break
            self._changed.clear()  # no await between the check and the clear: no wake-up is lost
            await self._changed.wait()
        self._outstanding[url] += 1
        if session_id is not None:
            self._sticky[session_id] = url
            self._sticky.move_to_end(session_id)
            if len(self._sticky) > _MAX_SESSIONS:
                self._sticky.popitem(last=False)
        return url

    def _release(self, url: str) -> None:
        if url in self._outstanding:
            self._outstanding[url] -= 1
        self._changed.set()

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self._clients[url].abort(rid)
        except ServerError as err:
            log.warning("abort of %s on %s failed: %s", rid, url, err)

    async def _each_alive(self, call) -> None:
        urls = self.alive()
        results = await asyncio.gather(*(call(self._clients[u]) for u in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, ServerUnavailable):
                self.mark_dead(url)
            elif isinstance(result, BaseException):
                raise result


def balancer_from_config(
    kind: ClientKind, cfg: RolloutConfig, urls: Sequence[str], token: str = ""
) -> LoadBalancer:
    """A balancer over the ``kind`` servers at ``urls`` (``cfg.backend``'s record, resolved by the caller)
    with the clients and limits ``cfg`` names; every client sends ``token`` (the servers' control token:
    aborts need it).

    The HTTP timeout of each client is a minute longer than ``cfg.request_timeout_s``, so the balancer's
    own timeout (abort there, retry elsewhere) is the one that fires.
    """
    clients = [client_for(kind, cfg, url).authorize(token) for url in urls]
    return LoadBalancer(
        clients,
        max_concurrent_per_server=cfg.max_concurrent_per_server,
        request_timeout_s=cfg.request_timeout_s,
    )
