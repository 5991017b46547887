"""The shape of a server description: endpoints, pause modes, generate routes, the weight-update sequence.

A :class:`ServerAPI` is data plus four small request builders (pause, resume, abort, abort all). It sends
nothing: :class:`~slipstream.serverapi.control.ServerControl` sends the control requests and the
rollouter's clients and the weight-sync adapters send the rest, each through its own HTTP client.

Our pause modes (design.md §3; ``weightsync.pause_mode``) are ``abort``, ``in_place``, ``retract`` and
``wait``. Each server maps the ones it can serve to its own names; :meth:`ServerAPI.pause_mode` refuses
the rest by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

OUR_PAUSE_MODES = ("abort", "in_place", "retract", "wait")

# The server kinds' names as the config's type: the choices of ``rollout.backend`` and
# ``reward.service.launch.backend`` (msgspec validates them, ``slipstream config show`` lists them). Written
# here, below the roles whose configs name it, because ``slipstream.serverkinds`` (the kinds' table) sits above
# them; a Literal must be written out for type checkers, and tests/test_serverkinds.py holds it to the keys of
# ``serverkinds.KINDS`` (in any order: it is the docs' order).
KindName = Literal["embedded", "vllm", "sglang"]


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Call:
    """One HTTP request to send: ``json`` None sends no body; ``params`` go in the query string.
    ``repeatable``: sending it twice leaves the server as sending it once (pause, resume, abort), so a
    connection dropped before the answer may be retried once."""

    method: str
    path: str
    json: Any = None
    params: Mapping[str, str] = field(default_factory=dict)
    repeatable: bool = False

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.method, self.path)


@dataclass(frozen=True)
class PauseMode:
    """One of our pause modes on one server.

    ``server``: the server's own name for it. ``in_flight``: what running requests do while paused:
    ``abort`` (they return now with their partial output and an ``abort`` finish), ``keep`` (they stay,
    KV cache and all, and continue after resume: on the old weights' cache if weights changed),
    ``retract`` (they go back to the waiting queue, their cache freed and recomputed after resume; the
    client sees nothing) or ``finish`` (the pause waits for them to complete). ``new_requests``: ``held`` (the server holds them until
    resume) or ``rejected`` (it answers 503 and the client retries). ``extra``: sent along with the mode.
    """

    server: str
    in_flight: Literal["abort", "keep", "retract", "finish"]
    new_requests: Literal["held", "rejected"]
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def keeps_requests(self) -> bool:
        """Running requests keep their cache: the server cannot flush it until they end (SGLang refuses)."""
        return self.in_flight == "keep"


@dataclass(frozen=True)
class GenerateRoute:
    """A token-in/token-out route, the abort that reaches its requests, and the id the server gives the
    engine request of our ``rid`` (what that abort must name)."""

    generate: Endpoint
    abort: Endpoint
    engine_id: str = "{rid}"

    def engine_request_id(self, rid: str) -> str:
        return self.engine_id.format(rid=rid)


@dataclass(frozen=True)
class WeightUpdate:
    """The endpoints a new version takes, in order, and where generation is paused around them.

    Per version: [pause] → ``begin`` → ``update`` once per bucket → ``end`` → [resume]. ``pause``:
    ``before`` pauses before ``begin`` and resumes after ``end`` (SGLang, vLLM); ``at_end`` keeps
    generating while buckets are staged and pauses only around ``end``, and only when the pause mode does
    not keep running requests (our embedded server). ``ranks`` asks how many group ranks the server
    takes (None: one); ``init_group``/``destroy_group`` join and leave the trainer's group.
    ``stream_prepare``/``stream_connect`` (paths with ``{stream}``, e.g. ``nixl``) open an in-band stream
    instead of per-bucket calls, where the server has one. ``end_aborts``: ``end`` takes
    ``abort_running: true`` and does the pause around the switch itself (aborts what runs, holds new
    requests, switches, resumes): one call per server where ``at_end`` would otherwise send three.
    ``engine`` says which weight-transfer engine the server runs, where it has several (vLLM's
    ``/server_info``; None: one).
    """

    init_group: Endpoint
    destroy_group: Endpoint
    begin: Endpoint
    update: Endpoint
    end: Endpoint
    pause: Literal["before", "at_end"] = "before"
    ranks: Endpoint | None = None
    stream_prepare: str = ""
    stream_connect: str = ""
    end_aborts: bool = False
    engine: Endpoint | None = None

    def endpoints(self) -> list[Endpoint]:
        eps = [self.init_group, self.destroy_group, self.begin, self.update, self.end]
        return eps + [ep for ep in (self.ranks, self.engine) if ep is not None]


@dataclass(frozen=True)
class ServerAPI(ABC):
    """Everything we rely on in one inference server's HTTP API (see the package docstring).

    ``dist``/``version``: the release on the package registry this description is written against (the
    contract checker reads exactly that release; empty for our own server). ``routes``: token-in/
    token-out routes by name, the first being the default.
    """

    kind: str
    dist: str
    version: str
    routes: Mapping[str, GenerateRoute]
    pause: Endpoint
    resume: Endpoint
    health: Endpoint
    model_info: Endpoint
    weight_version: Endpoint
    pause_modes: Mapping[str, PauseMode]
    weights: WeightUpdate

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    def route(self, name: str | None = None) -> GenerateRoute:
        """The generate route ``name`` (None: the default one)."""
        if name is None:
            return next(iter(self.routes.values()))
        if name not in self.routes:
            raise ValueError(f"{self.kind} has no generate route {name!r}; known: {', '.join(self.routes)}")
        return self.routes[name]

    def pause_mode(self, mode: str) -> PauseMode:
        """How ``mode`` (our name) reads on this server; ``ValueError`` naming the modes it has."""
        if mode not in self.pause_modes:
            raise ValueError(f"{self.kind} pause modes are {list(self.pause_modes)}, got {mode!r}")
        return self.pause_modes[mode]

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint this description names (what the contract checker looks up upstream)."""
        eps = [ep for r in self.routes.values() for ep in (r.generate, r.abort)]
        eps += [self.pause, self.resume, self.health, self.model_info, self.weight_version]
        eps += [self.abort_all_call().endpoint, *self.weights.endpoints()]
        return list(dict.fromkeys(eps))

    @abstractmethod
    def pause_call(self, mode: str) -> Call:
        """The request that pauses generation in ``mode`` (our name)."""

    @abstractmethod
    def resume_call(self) -> Call:
        """The request that resumes generation after any pause."""

    @abstractmethod
    def abort_call(self, rid: str, route: str | None = None) -> Call:
        """The request that stops our request ``rid`` sent on generate route ``route``."""

    @abstractmethod
    def abort_all_call(self) -> Call:
        """The request that stops every request on the server."""
