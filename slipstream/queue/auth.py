"""Who may talk to a queue server bound beyond loopback: holders of its token.

Why: a server reachable from other machines would otherwise serve anyone on the network (put, lease, ack,
snapshot). Every ZeroMQ socket of such a server requires ZeroMQ's PLAIN handshake with the token as password,
checked by pyzmq's ZAP authenticator thread before a single message is read; a peer without it never gets
a message through. PLAIN authenticates but does not encrypt: run the queue on a private network.

Where the token comes from (``queue.auth_token``):

* ``"auto"`` (the default): none on loopback; a random one for any other bind;
* a literal secret: always required, loopback included;
* ``""``: none, and then only a loopback bind is allowed (any other is refused with an error saying why).

Clients get the token inside the server's address, ``tcp://TOKEN@host:port`` (what ``QueueServer.address``,
``QueueServerHandle.address`` and ``QueueServerActor.address()`` return), as ``QueueClient(token=...)``, or
from ``$SLIPSTREAM_QUEUE_TOKEN``. Servers with a token serve no direct channel or ``ipc://`` endpoints (they
carry no ZeroMQ handshake); same-host clients still move payloads through shared memory.

Example::

    server = QueueServer(QueueConfig(host="0.0.0.0"))   # "auto": a random token
    server.address                                      # "tcp://Xq3...@10.0.0.5:41234"
    QueueClient(server.address).ping()                  # authenticated
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import zmq

from slipstream.queue.config import QueueConfig
from slipstream.utils.net import is_loopback

TOKEN_ENV = "SLIPSTREAM_QUEUE_TOKEN"
USER = b"slipstream"


def server_token(cfg: QueueConfig) -> str:
    """The token clients of a server with ``cfg`` must present ("" for none); ValueError for a bind beyond
    loopback without one."""
    loopback = is_loopback(cfg.host)
    if cfg.auth_token == "auto":
        return "" if loopback else secrets.token_urlsafe(24)
    if not cfg.auth_token and not loopback:
        raise ValueError(
            f"queue.host={cfg.host!r} is reachable from other machines, and queue.auth_token is empty: refusing "
            'to serve without authentication. Set queue.auth_token ("auto" makes a random token, carried in '
            "the server's address) or bind 127.0.0.1"
        )
    return cfg.auth_token


def split_address(address: str) -> tuple[str, str]:
    """``tcp://TOKEN@host:port`` -> (``tcp://host:port``, TOKEN); a plain address has the token ""."""
    scheme, sep, rest = address.partition("://")
    token, at, hostport = rest.rpartition("@")
    if not sep or not at:
        return address, ""
    return f"{scheme}://{hostport}", token


def with_token(address: str, token: str) -> str:
    return address.replace("://", f"://{token}@", 1) if token else address


def client_token(address_token: str, given: str | None) -> str:
    """A client's token: given explicitly, else in the address, else from ``$SLIPSTREAM_QUEUE_TOKEN``."""
    return given or address_token or os.environ.get(TOKEN_ENV, "")


class Gate:
    """The ZAP authenticator of one server's context; ``secure(socket)`` before binding it."""

    def __init__(self, ctx: zmq.Context, token: str) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.token = token
        self._auth: Any = None
        if token:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_plain(domain="*", passwords={USER.decode(): token})

    def secure(self, sock: zmq.Socket) -> None:
        if self.token:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def authenticate(sock: zmq.Socket, token: str) -> None:
    """Make a client socket present ``token`` (no-op without one)."""
    if token:
        sock.setsockopt(zmq.PLAIN_USERNAME, USER)
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
