"""Inference-server clients behind one interface; the kind comes from whoever chose it.

Each kind's client class is part of its record in ``slipstream.serverkinds`` (its module defines it), built
with the kind's API description: the embedded server speaks SGLang's native API, so its record names
``SGLangClient`` with the embedded description (its own pause modes). The rollouter never looks a kind up
by name: the composition root (the pipeline's rollout actor, a command, a test) resolves
``server_kind(rollout.backend)`` once and hands the record down, typed here by :class:`ClientKind`. To add a
server kind: see ``slipstream.serverkinds``.

Example::

    kind = server_kind("vllm")                       # above the rollouter
    client = client_for(kind, rollout_cfg, "http://127.0.0.1:8000")
"""

from __future__ import annotations

from typing import Protocol

from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import ServerAPI


class ClientKind(Protocol):
    """What the rollouter needs of a server kind (``slipstream.serverkinds.ServerKind`` is one)."""

    @property
    def client(self) -> type[ServerClient]: ...
    @property
    def api(self) -> ServerAPI: ...


def make_client(kind: ClientKind, base_url: str, **kwargs) -> ServerClient:
    """A client of ``kind`` for the server at ``base_url``, speaking the API its description gives."""
    return kind.client(base_url, server_api=kind.api, **kwargs)


def client_for(kind: ClientKind, cfg: RolloutConfig, base_url: str) -> ServerClient:
    """The client the rollouter uses for a ``kind`` server (``cfg.backend``'s) at ``base_url``: its HTTP
    timeout a minute past ``cfg.request_timeout_s`` (so the balancer's own timeout fires first) and the kind's
    own options from ``cfg`` (vLLM: the generate route)."""
    options = kind.client.options_from(cfg)
    return make_client(kind, base_url, timeout_s=cfg.request_timeout_s + 60.0, **options)


__all__ = [
    "ClientKind",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "client_for",
    "make_client",
]
