"""One description of each inference server's HTTP API, used by the rollouter and weight sync alike.

A :class:`ServerAPI` per backend (``embedded``, ``sglang``, ``vllm``) says which release it is written
against, its endpoint paths, how our pause modes read on it (and what each does to running and new
requests), how a request is aborted, and the endpoint sequence a new weight version takes. The
rollouter's clients (``rollouter/clients``) and the weight-sync adapters (``weightsync/adapters.py``)
read their paths from it, and both pause, resume and abort only through :class:`ServerControl`. The
contract checker (``slipstream.contracts``) pins the releases named here and looks every endpoint up in
their sources, so moving to a new release is a change to one description.

This package imports no role: ``rollouter/`` and ``weightsync/`` both import it.

Each kind's description is part of its record in ``slipstream.serverkinds`` (with its client, adapter and
launcher); :data:`SERVER_APIS` and :func:`server_api` read those records by name, importing a kind's module
only when it is asked for. To add a server kind: write ``<kind>.py`` here with a :class:`ServerAPI` subclass
(its four control requests) and one instance, then the kind's module in ``slipstream.serverkinds`` (its
docstring has the steps).

Example::

    api = server_api("vllm")
    api.pause_call("in_place")    # Call(method="POST", path="/pause", params={"mode": "keep"})
    api.weights.begin.path        # "/start_weight_update"
"""

from __future__ import annotations

from slipstream.serverapi.control import ServerControl
from slipstream.serverapi.embedded import EMBEDDED
from slipstream.serverapi.sglang import SGLANG, SGLangAPI
from slipstream.serverapi.spec import (
    OUR_PAUSE_MODES,
    Call,
    Endpoint,
    GenerateRoute,
    PauseMode,
    ServerAPI,
    WeightUpdate,
)
from slipstream.serverapi.vllm import VLLM, VLLMAPI
from slipstream.serverkinds import KindField, server_kind

# The description of each kind (``rollout.backend``), from its record in ``slipstream.serverkinds``.
SERVER_APIS: KindField = KindField("api")


def server_api(kind: str) -> ServerAPI:
    """The description of server kind ``kind``; ``ValueError`` naming the known kinds."""
    return server_kind(kind).api


__all__ = [
    "EMBEDDED",
    "OUR_PAUSE_MODES",
    "SERVER_APIS",
    "SGLANG",
    "VLLM",
    "VLLMAPI",
    "Call",
    "Endpoint",
    "GenerateRoute",
    "PauseMode",
    "SGLangAPI",
    "ServerAPI",
    "ServerControl",
    "WeightUpdate",
    "server_api",
]
