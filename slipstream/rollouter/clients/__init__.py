"""Inference-server clients behind one interface, chosen by the config string ``rollout.backend``.

Each kind's client class is part of its record in ``slipstream.serverkinds`` (``server_kind(name).client``,
built with the kind's API description): the embedded server speaks SGLang's native API, so its record names
:class:`SGLangClient` with the embedded description (its own pause modes). :data:`CLIENT_KINDS` is a view of
those records; the shipped client classes stay importable from here. To add a server kind: see
``slipstream.serverkinds``.
"""

from __future__ import annotations

import importlib
from typing import Any

from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverkinds import KindField, server_kind

CLIENT_KINDS: KindField = KindField("client")
# The clients of the kinds we ship, importable from here as before (each defined in its kind's module).
_MOVED = {"SGLangClient": "slipstream.serverkinds.sglang", "VLLMClient": "slipstream.serverkinds.vllm"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # by string: the kinds' modules import this package's base
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_client(kind: str, base_url: str, **kwargs) -> ServerClient:
    """A client of ``kind`` (embedded, sglang or vllm) for the server at ``base_url``, speaking the API
    that ``slipstream.serverapi`` describes for ``kind``."""
    record = server_kind(kind)
    return record.client(base_url, server_api=record.api, **kwargs)


def client_for(cfg: RolloutConfig, base_url: str) -> ServerClient:
    """The client the rollouter uses for the ``cfg.backend`` server at ``base_url``: its HTTP timeout a
    minute past ``cfg.request_timeout_s`` (so the balancer's own timeout fires first) and the kind's own
    options from ``cfg`` (vLLM: the generate route)."""
    options = server_kind(cfg.backend).client.options_from(cfg)
    return make_client(cfg.backend, base_url, timeout_s=cfg.request_timeout_s + 60.0, **options)


__all__ = [
    "CLIENT_KINDS",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "client_for",
    "make_client",
]
