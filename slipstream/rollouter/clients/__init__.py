"""Inference-server clients behind one interface, chosen by the config string ``rollout.backend``.

To add a server kind: describe its API in ``slipstream.serverapi``, write a :class:`ServerClient`
subclass in its own module and add it to :data:`CLIENT_KINDS`. The embedded server speaks SGLang's
native API, so it uses :class:`SGLangClient` with the embedded description (its own pause modes).
"""

from __future__ import annotations

from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.clients.sglang import SGLangClient
from slipstream.rollouter.clients.vllm import VLLMClient
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import server_api
from slipstream.utils.registry import Registry

CLIENT_KINDS: Registry[type[ServerClient]] = Registry(
    "inference server kind", "rollout.backend", plural="kinds"
)
CLIENT_KINDS.add("embedded", SGLangClient)
CLIENT_KINDS.add("sglang", SGLangClient)
CLIENT_KINDS.add("vllm", VLLMClient)


def make_client(kind: str, base_url: str, **kwargs) -> ServerClient:
    """A client of ``kind`` (embedded, sglang or vllm) for the server at ``base_url``, speaking the API
    that ``slipstream.serverapi`` describes for ``kind``."""
    return CLIENT_KINDS.get(kind)(base_url, server_api=server_api(kind), **kwargs)


def client_for(cfg: RolloutConfig, base_url: str) -> ServerClient:
    """The client the rollouter uses for the ``cfg.backend`` server at ``base_url``: its HTTP timeout a
    minute past ``cfg.request_timeout_s`` (so the balancer's own timeout fires first) and the kind's own
    options from ``cfg`` (vLLM: the generate route)."""
    cls = CLIENT_KINDS.get(cfg.backend)
    options = cls.options_from(cfg)
    return make_client(cfg.backend, base_url, timeout_s=cfg.request_timeout_s + 60.0, **options)


__all__ = [
    "CLIENT_KINDS",
    "SGLangClient",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "VLLMClient",
    "client_for",
    "make_client",
]
