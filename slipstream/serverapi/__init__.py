"""One description of each inference server's HTTP API, used by the rollouter and weight sync alike.

A :class:`ServerAPI` per backend (``embedded``, ``sglang``, ``vllm``) says which release it is written
against, its endpoint paths, how our pause modes read on it (and what each does to running and new
requests), how a request is aborted, and the endpoint sequence a new weight version takes. The
rollouter's clients (``rollouter/clients``) and the weight-sync adapters (``weightsync/adapters.py``)
read their paths from it, and both pause, resume and abort only through :class:`ServerControl`. The
contract checker (``slipstream.contracts``) pins the releases named here and looks every endpoint up in
their sources, so moving to a new release is a change to one description.

This package imports no role, nor ``slipstream.serverkinds``: ``rollouter/`` and ``weightsync/`` both import
it, and each kind's description reaches them inside its record (``serverkinds``, with its client, adapter and
launcher), handed down by whoever chose the kind. :data:`KindName` (the kinds' names, the config's type) lives
here for the same reason. To add a server kind: write ``<kind>.py`` here with a :class:`ServerAPI` subclass
(its four control requests) and one instance, then the kind's module in ``slipstream.serverkinds`` (its
docstring has the steps).

Example::

    api = VLLM
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
    KindName,
    PauseMode,
    ServerAPI,
    WeightUpdate,
)
from slipstream.serverapi.vllm import VLLM, VLLMAPI

__all__ = [
    "EMBEDDED",
    "OUR_PAUSE_MODES",
    "SGLANG",
    "VLLM",
    "VLLMAPI",
    "Call",
    "Endpoint",
    "GenerateRoute",
    "KindName",
    "PauseMode",
    "SGLangAPI",
    "ServerAPI",
    "ServerControl",
    "WeightUpdate",
]
