"""The bearer token that guards an inference server's control and weight-update endpoints.

Why: generation is harmless to share on one machine, but control is not. Without a token, any process that
reaches a server can pause it, abort other clients' requests, or join a process group of its own and
install weights under a version number so high that every real push is refused as older.

Who holds the token: the server reads it from ``$SLIPSTREAM_SERVER_TOKEN`` (never from its command line,
which every user of the machine can read with ``ps``); the pipeline makes one per run
(:func:`new_token`) and hands it to its servers through their environment and to the weight publisher
and the rollouter's clients as an argument. Clients send it as ``Authorization: Bearer <token>``
(:func:`bearer_headers`); the server compares it in constant time (:func:`token_matches`).

Example::

    token = new_token()
    httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, headers=bearer_headers(token))
"""

from __future__ import annotations

import hmac
import os
import secrets

from slipstream.utils.net import is_loopback

TOKEN_ENV = "SLIPSTREAM_SERVER_TOKEN"


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def env_token() -> str:
    """The token in ``$SLIPSTREAM_SERVER_TOKEN`` ("" when unset)."""
    return os.environ.get(TOKEN_ENV, "").strip()


def bearer_headers(token: str) -> dict[str, str]:
    """The request headers that present ``token`` (none for an empty token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def token_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header value presents ``token`` (compared in constant time)."""
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def check_bind(host: str, token: str) -> None:
    """Refuse (ValueError, saying what to do) a server bound beyond loopback without a token."""
    if not token and not is_loopback(host):
        raise ValueError(
            f"--host {host} makes this server reachable from other machines, and no token is set: refusing to "
            f"start without authentication. Put a secret in ${TOKEN_ENV} (clients send it as "
            "`Authorization: Bearer <token>`) or bind 127.0.0.1"
        )
