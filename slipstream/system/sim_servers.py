"""Simulated inference servers: many SGLang-style HTTP servers in one asyncio process, no model.

Used to drive the control plane (queue, rollouter, balancer, partial rollouts, weight publisher) at a scale
no CPU machine could serve with real models: ``slipstream bench scale`` runs 8 to 256 of them. Each
:class:`SimServer` listens on its own loopback port and speaks the subset of SGLang's native API that
:class:`~slipstream.serverkinds.sglang.SGLangClient` and the ``embedded`` weight-sync adapter use:

=================================  =====================================================================
``POST /generate``                 ``input_ids``, ``sampling_params``, ``rid`` → ``output_ids`` and
                                   ``meta_info`` (``finish_reason``, ``output_token_logprobs``,
                                   ``weight_version``, ``weight_versions`` spans), after the response's
                                   simulated decode time; held while the server is paused
``POST /abort_request``            ``{"rid"}`` or ``{"abort_all": true}``: the pending request returns the
                                   tokens made so far with ``finish_reason.type == "abort"``
``POST /pause_generation``         ``abort`` / ``retract``: abort everything running; ``in_place``: freeze
``POST /continue_generation``      unfreeze and let held requests start
``GET /health``, ``/model_info``   200; ``weight_version`` as a string, as SGLang sends it
weight-update routes               ``/begin_weight_update``, ``/update_weights_from_distributed``,
                                   ``/end_weight_update`` (switches the version: later tokens carry it;
                                   ``abort_running`` aborts what runs first),
                                   ``/init_weights_update_group``, ``/destroy_weights_update_group``:
                                   control only, no weight bytes are received
=================================  =====================================================================

Decoding is a clock, not a loop: a request draws its length from :class:`SimProfile` (log-normal around
``median_tokens``, capped by its ``max_new_tokens``) and finishes ``length / tokens_per_s`` seconds later
(one timer); an abort, a freeze or a version switch computes how many tokens exist at that instant. So a
server's CPU cost is per request, never per token, and one process hosts hundreds of them.

The HTTP/1.1 layer is a few lines over ``asyncio`` streams (keep-alive, ``Content-Length`` bodies only)
rather than FastAPI/uvicorn: with hundreds of servers in one process, a framework's per-request overhead
would make the simulator, not the control plane under test, what limits the run. It binds loopback only.

Worked example::

    pool = SimPool(SimProfile(tokens_per_s=50, median_tokens=32))
    urls = await pool.start(4)          # ["http://127.0.0.1:41233", ...]
    ...                                 # SGLangClient(urls[0]).generate(...)
    await pool.stop()

``python -m slipstream.system.sim_servers --servers 64 --tokens-per-s 20`` runs a pool in its own process and
prints one JSON line ``{"urls": [...]}`` once every server listens; it exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any

import msgspec

from slipstream.utils.net import LOOPBACK

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 411: "Length Required", 500: "Error"}
_MAX_BODY = 64 << 20


class SimProfile(msgspec.Struct, kw_only=True):
    """How simulated servers generate: per-request decode rate and the response-length distribution."""

    # Tokens per second of one request (all requests of a server decode at this rate at once).
    tokens_per_s: float = 20.0
    # Median response length in tokens; lengths are log-normal with ``length_sigma``, capped by the request.
    median_tokens: int = 32
    length_sigma: float = 0.6
    seed: int = 0


class _Req:
    """One request in flight: a decode clock that can be frozen, re-versioned and stopped."""

    __slots__ = ("rid", "target", "done", "since", "spans", "timer", "future", "rate", "stop_id")

    def __init__(self, rid: str, target: int, rate: float, version: int, stop_id: int | None) -> None:
        self.rid = rid
        self.target = target
        self.rate = rate
        self.stop_id = stop_id
        self.done = 0.0  # tokens made before the current running stretch
        self.since: float | None = None  # start of the running stretch; None while frozen
        self.spans: list[list[int]] = [[version, 0]]  # [version, first token index]
        self.timer: asyncio.TimerHandle | None = None
        self.future: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def made(self, now: float) -> int:
        running = (now - self.since) * self.rate if self.since is not None else 0.0
        return min(self.target, int(self.done + running))

    def run(self, now: float) -> None:
        self.since = now
        delay = max(0.0, (self.target - self.done) / self.rate)
        self.timer = asyncio.get_running_loop().call_later(delay, self.finish, "done")

    def freeze(self, now: float) -> None:
        if self.since is not None:
            self.done = float(self.made(now))
            self.since = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def finish(self, reason: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.future.done():
            self.future.set_result(reason)


class SimServer:
    """One simulated server (see the module docstring); lives on the event loop of its :class:`SimPool`."""

    def __init__(self, profile: SimProfile, rng: random.Random) -> None:
        self.profile = profile
        self.rng = rng
        self.version = 0
        self.staged: int | None = None
        self.frozen = False  # in-place pause: running requests stop making tokens
        self.open = asyncio.Event()  # cleared while paused: new requests wait
        self.open.set()
        self.requests: dict[str, _Req] = {}
        self.counts = {"generate": 0, "abort": 0, "pause": 0, "weight_updates": 0, "tokens": 0}
        self.server: asyncio.base_events.Server | None = None
        self.url = ""

    # -- HTTP

    async def listen(self, host: str = LOOPBACK) -> str:
        self.server = await asyncio.start_server(self._serve, host, 0, backlog=1024)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        return self.url

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                method, path, length, close = _parse_head(head)
                if length < 0:
                    writer.write(_response(411, {"error": "Content-Length required"}, close=True))
                    return
                body = await reader.readexactly(length) if length else b""
                status, payload = await self._route(method, path, body)
                writer.write(_response(status, payload, close))
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        path = path.split("?", 1)[0]
        try:
            data = msgspec.json.decode(body) if body else {}
            if path == "/generate" and method == "POST":
                return 200, await self.generate(data)
            handler = self._control.get(path)
            if handler is None:
                return 404, {"error": {"message": f"no route {method} {path}"}}
            return 200, handler(self, data)
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as err:
            return 400, {"error": {"message": f"{type(err).__name__}: {err}"}}

    # -- generation

    async def generate(self, data: dict) -> dict:
        rid = str(data.get("rid") or f"sim-{self.rng.getrandbits(48):x}")
        params = data.get("sampling_params") or {}
        budget = int(params.get("max_new_tokens", 128))
        prompt_tokens = len(data.get("input_ids") or [])
        stops = params.get("stop_token_ids") or []
        self.counts["generate"] += 1
        if not self.open.is_set():
            await self.open.wait()
        req = _Req(
            rid, self._length(budget), self.profile.tokens_per_s, self.version, stops[0] if stops else None
        )
        self.requests[rid] = req
        loop = asyncio.get_running_loop()
        try:
            if not self.frozen:
                req.run(loop.time())
            reason = await req.future
        finally:
            self.requests.pop(rid, None)
        n = req.target if reason == "done" else req.made(loop.time())
        finish = "abort" if reason != "done" else ("length" if n >= budget else "stop")
        return self._payload(req, n, finish, prompt_tokens, budget)

    def _length(self, budget: int) -> int:
        p = self.profile
        n = int(round(p.median_tokens * math.exp(self.rng.gauss(0.0, p.length_sigma))))
        return max(1, min(budget, n))

    def _payload(self, req: _Req, n: int, finish: str, prompt_tokens: int, budget: int) -> dict:
        ids = [65 + (i % 26) for i in range(n)]
        if finish == "stop" and req.stop_id is not None and n:
            ids[-1] = req.stop_id
        self.counts["tokens"] += n
        spans = []
        for k, (version, start) in enumerate(req.spans):
            end = req.spans[k + 1][1] if k + 1 < len(req.spans) else n
            end = min(end, n)
            if end > start:
                spans.append({"version": str(version), "start": start, "end": end})
        return {
            "output_ids": ids,
            "meta_info": {
                "id": req.rid,
                "finish_reason": {"type": finish},
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "weight_version": str(req.spans[-1][0]),
                "weight_versions": spans,
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
            },
        }

    # -- control

    def abort(self, data: dict) -> dict:
        self.counts["abort"] += 1
        if data.get("abort_all"):
            for req in list(self.requests.values()):
                req.finish("abort")
        elif data.get("rid") in self.requests:
            self.requests[data["rid"]].finish("abort")
        return {"success": True}

    def pause(self, data: dict) -> dict:
        self.counts["pause"] += 1
        self.open.clear()
        mode = data.get("mode", "abort")
        if mode == "in_place":
            now = asyncio.get_running_loop().time()
            self.frozen = True
            for req in self.requests.values():
                req.freeze(now)
        else:
            for req in list(self.requests.values()):
                req.finish("abort")
        return {"status": "ok", "message": "Generation paused successfully."}

    def resume(self, data: dict) -> dict:
        if self.frozen:
            now = asyncio.get_running_loop().time()
            self.frozen = False
            for req in self.requests.values():
                if not req.future.done() and req.since is None:
                    req.run(now)
        self.open.set()
        return {"status": "ok", "message": "Generation continued successfully."}

    def begin_update(self, data: dict) -> dict:
        self.staged = int(data.get("weight_version", self.version + 1))
        return {"success": True, "message": "begun"}

    def end_update(self, data: dict) -> dict:
        version = int(data.get("weight_version", self.staged if self.staged is not None else self.version))
        if data.get("abort_running"):  # the pause around the switch, taken and lifted here
            self.counts["pause"] += 1
            for req in list(self.requests.values()):
                req.finish("abort")
        now = asyncio.get_running_loop().time()
        for req in self.requests.values():
            made = req.made(now)
            if req.spans[-1][1] == made:
                req.spans[-1][0] = version
            else:
                req.spans.append([version, made])
        self.version, self.staged = version, None
        self.counts["weight_updates"] += 1
        return {"success": True, "message": f"serving version {version}"}

    def model_info(self, data: dict) -> dict:
        return {
            "model_path": "simulated",
            "weight_version": str(self.version),
            "paused": not self.open.is_set(),
            "num_running_requests": len(self.requests),
            "server": "slipstream-sim",
        }

    def ok(self, data: dict) -> dict:
        return {"success": True, "message": "ok"}

    _control = {
        "/abort_request": abort,
        "/pause_generation": pause,
        "/continue_generation": resume,
        "/begin_weight_update": begin_update,
        "/end_weight_update": end_update,
        "/update_weights_from_distributed": ok,
        "/init_weights_update_group": ok,
        "/destroy_weights_update_group": ok,
        "/flush_cache": ok,
        "/model_info": model_info,
        "/health": ok,
    }


def _parse_head(head: bytes) -> tuple[str, str, int, bool]:
    """Method, path, Content-Length (-1 for a chunked body) and whether the client asked to close."""
    lines = head.decode("latin-1").split("\r\n")
    method, path, version = lines[0].split(" ", 2)
    length, close = 0, version == "HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            length = -1
        elif name == "connection":
            close = value.strip().lower() == "close"
    if length > _MAX_BODY:
        raise ValueError(f"body of {length} bytes")
    return method, path, length, close


def _response(status: int, payload: Any, close: bool) -> bytes:
    body = msgspec.json.encode(payload)
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    )
    return head.encode("latin-1") + body


class SimPool:
    """Many :class:`SimServer` on one event loop, each on its own loopback port."""

    def __init__(self, profile: SimProfile) -> None:
        self.profile = profile
        self.servers: list[SimServer] = []

    async def start(self, count: int, host: str = LOOPBACK) -> list[str]:
        base = self.profile.seed * 1_000_003
        new = [SimServer(self.profile, random.Random(base + len(self.servers) + i)) for i in range(count)]
        urls = [await s.listen(host) for s in new]
        self.servers.extend(new)
        return urls

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for server in self.servers:
            for key, value in server.counts.items():
                total[key] = total.get(key, 0) + value
        return total

    async def stop(self) -> None:
        for server in self.servers:
            for req in list(server.requests.values()):
                req.finish("abort")
            if server.server is not None:
                server.server.close()
        for server in self.servers:
            if server.server is not None:
                await server.server.wait_closed()


async def _serve_until_stdin_closes(args: argparse.Namespace) -> None:
    profile = SimProfile(
        tokens_per_s=args.tokens_per_s,
        median_tokens=args.median_tokens,
        length_sigma=args.length_sigma,
        seed=args.seed,
    )
    pool = SimPool(profile)
    urls = await pool.start(args.servers)
    print(json.dumps({"urls": urls}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(json.dumps({"counts": pool.counts(), "time": time.time()}), flush=True)
    await pool.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slipstream.system.sim_servers", description=__doc__.split("\n")[0]
    )
    # Hand-written: the simulated servers' decode model, no config key.
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--tokens-per-s", type=float, default=20.0)
    p.add_argument("--median-tokens", type=int, default=32)
    p.add_argument("--length-sigma", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import gc

    gc.freeze()
    asyncio.run(_serve_until_stdin_closes(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
