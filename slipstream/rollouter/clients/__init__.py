"""Inference-server clients behind one interface, chosen by the config string ``rollout.backend``.

To add a server kind: describe its API in ``slipstream.serverapi``, write a :class:`ServerClient`
subclass in its own module and add a row to :data:`CLIENT_KINDS`. The embedded server speaks SGLang's
native API, so it uses :class:`SGLangClient` with the embedded description (its own pause modes).
"""

from __future__ import annotations

from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.clients.sglang import SGLangClient
from slipstream.rollouter.clients.vllm import VLLMClient
from slipstream.serverapi import server_api

CLIENT_KINDS: dict[str, type[ServerClient]] = {
    "embedded": SGLangClient,
    "sglang": SGLangClient,
    "vllm": VLLMClient,
}


def make_client(kind: str, base_url: str, **kwargs) -> ServerClient:
    """A client of ``kind`` (embedded, sglang or vllm) for the server at ``base_url``, speaking the API
    that ``slipstream.serverapi`` describes for ``kind``."""
    cls = CLIENT_KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown inference server kind {kind!r}; known: {', '.join(CLIENT_KINDS)}")
    return cls(base_url, server_api=server_api(kind), **kwargs)


__all__ = [
    "CLIENT_KINDS",
    "SGLangClient",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "VLLMClient",
    "make_client",
]
