"""Inference-server clients behind one interface, chosen by the config string ``rollout.backend``.

To add a server kind: write a :class:`ServerClient` subclass in its own module and add a row to
:data:`CLIENT_KINDS`. The embedded server speaks SGLang's native API, so it uses :class:`SGLangClient`.
"""

from __future__ import annotations

from slipstream.rollouter.clients.base import ServerClient, ServerError, ServerUnavailable
from slipstream.rollouter.clients.sglang import SGLangClient
from slipstream.rollouter.clients.vllm import VLLMClient

CLIENT_KINDS: dict[str, type[ServerClient]] = {
    "embedded": SGLangClient,
    "sglang": SGLangClient,
    "vllm": VLLMClient,
}


def make_client(kind: str, base_url: str, **kwargs) -> ServerClient:
    """A client of ``kind`` (embedded, sglang or vllm) for the server at ``base_url``."""
    cls = CLIENT_KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown inference server kind {kind!r}; known: {', '.join(CLIENT_KINDS)}")
    return cls(base_url, **kwargs)


__all__ = [
    "CLIENT_KINDS",
    "SGLangClient",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "VLLMClient",
    "make_client",
]
