"""What the blocking and the asyncio queue clients share: the address and token, the session a HELLO made,
socket set-up, request stamping (id, owner secret), abandoned replies and connection-failure bookkeeping.

Kept apart from :mod:`slipstream.queue.client` so that each client there is only its driver (blocking socket
IO or the event loop) around the operations of :mod:`slipstream.queue.ops`.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from typing import Any

import zmq

from slipstream.queue import auth, ops
from slipstream.queue import protocol as P
from slipstream.queue.codec import Codec
from slipstream.queue.direct import DirectSocket
from slipstream.queue.errors import QueueError, QueueUnreachable
from slipstream.queue.ops import CONTROLLER, Call, Session
from slipstream.utils.logging import get_logger
from slipstream.utils.net import is_loopback

log = get_logger(__name__)

_ABANDONED_KEPT = 1024
# Seconds a timed-out client with a token waits for the server to answer a ping without it (the diagnosis).
_PROBE_S = 1.0


class ClientBase:
    """Socket bookkeeping shared by both clients."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        shared_memory: bool,
        ipc: bool,
        token: str | None,
        owner: bytes | None,
    ) -> None:
        address, in_address = auth.split_address(address)
        if not address.startswith("tcp://") or ":" not in address[6:]:
            raise ValueError(
                f"queue address {address!r}: expected tcp://HOST:PORT (or tcp://TOKEN@HOST:PORT)"
            )
        self.address = address  # without the token: it is shown in errors and logs
        self._token = auth.client_token(in_address, token)
        self._token_from = (
            "" if not self._token else "token=" if token else "the address" if in_address
            else f"${auth.TOKEN_ENV}"
        )  # fmt: skip
        self.timeout_s = timeout_s
        self._use_shm = shared_memory
        self._use_ipc = ipc
        self._codec = Codec()
        self._ids = itertools.count(1)
        self._session: Session | None = None
        self._held: set[str] = set()
        self._abandoned: dict[int, P.MsgType] = {}
        self._closed = False
        # This client's secret: the server binds the leases and arena credits it grants to it, so no other
        # client can ack, nack, fetch, commit or release them, even knowing their ids.
        if owner is not None and len(owner) < 16:
            raise ValueError("owner: give at least 16 random bytes (it is what makes leases this client's)")
        self._owner = owner or secrets.token_bytes(16)
        self._nonce = b""  # of the server last said HELLO to (a new one: it restarted)

    def _stamp(self, header: Any) -> None:
        """Fill in a request's id and, where it has one, its owner secret."""
        header.req_id = next(self._ids)
        if hasattr(header, "owner"):
            header.owner = self._owner

    def _closing_ops(self) -> list[ops.Op]:
        """Nack the leases still held and release unused arena credits."""
        out = [ops.nack(lease_id) for lease_id in list(self._held)]
        if self._session is not None:
            out.append(ops.release_credits(self._session))
        return out

    def _endpoint(self, target: int) -> str:
        session = self._session
        if target == CONTROLLER:
            return self.address
        assert session is not None
        if session.direct and session.units[target].ipc:  # same host: a Unix domain socket
            return session.units[target].ipc
        host = self.address[6:].rsplit(":", 1)[0]
        return f"tcp://{host}:{session.units[target].port}"

    def _new_socket(self, target: int) -> Any:
        """The controller's direct channel once HELLO found it reachable, else a ZeroMQ DEALER."""
        if target == CONTROLLER and self._session is not None and self._session.direct:
            try:
                return DirectSocket(self._session.direct, self.timeout_s)
            except OSError as err:  # the server is gone (its abstract name with it)
                raise QueueUnreachable(f"direct channel to the queue server: {err}", sent=False) from None
        sock = self._ctx.socket(zmq.DEALER)
        self._configure(sock)
        auth.authenticate(sock, self._token)
        sock.connect(self._endpoint(target))
        return sock

    @property
    def transport(self) -> str:
        """``unix`` (the direct channel and ipc://) or ``tcp``: how this client reaches the server (known
        after its first call)."""
        return "unix" if self._session is not None and self._session.direct else "tcp"

    @staticmethod
    def _configure(sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)

    def _wait(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else max(0.0, float(timeout_s))

    @staticmethod
    def _put_wait(timeout_s: float | None) -> float | None:
        return None if timeout_s is None else max(0.0, float(timeout_s))  # None: the server's put_timeout_s

    def _deadline(self, calls: Sequence[Call]) -> float:
        return max(c.server_wait_s for c in calls) + self.timeout_s

    def _abandon(self, req_id: int, msg_type: P.MsgType) -> None:
        self._abandoned[req_id] = msg_type
        while len(self._abandoned) > _ABANDONED_KEPT:
            self._abandoned.pop(next(iter(self._abandoned)))

    def _stale_lease(self, frames: list[Any]) -> str:
        """A reply nobody waits for any more; if it granted a lease, its id (to give the groups back)."""
        msg_type = self._abandoned.pop(self._codec.req_id(frames[1]), None) if len(frames) > 1 else None
        if msg_type != P.MsgType.LEASE:
            return ""
        try:
            reply = self._codec.decode_reply(frames, P.MsgType.LEASE)
        except Exception:  # noqa: BLE001 - a late reply we cannot read is not worth failing over
            return ""
        return getattr(reply, "lease_id", "")

    def _reply(self, frames: list[Any], call: Call) -> Any:
        reply = ops.raise_for(self._codec.decode_reply(frames, call.msg_type))
        return (reply, frames[2:]) if call.with_buffers else reply

    def _timeout_error(self, wait_s: float) -> QueueError:
        hint = "is it running?"
        if not self._token and not is_loopback(self.address[6:].rsplit(":", 1)[0]):
            hint += f" A server beyond loopback needs its token: tcp://TOKEN@host:port or ${auth.TOKEN_ENV}"
        elif self._token and self._answers_without_token():
            hint = (
                f"it answers clients without a token, and this one presents a token (from {self._token_from}), "
                "which a server without a token never answers: drop the token"
                + (f" (unset ${auth.TOKEN_ENV})" if self._token_from.startswith("$") else "")
                + " or start the server with queue.auth_token set to it"
            )
        return QueueUnreachable(
            f"no reply from the queue server at {self.address} within {wait_s:.1f}s ({hint})", sent=True
        )

    def _answers_without_token(self) -> bool:
        """Whether the server answers a ping sent without a token (blocks up to ``_PROBE_S``; only on the way
        to a time-out error, where a token mismatch is the likely cause: ZeroMQ's handshake fails silently)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            sock.send_multipart(self._codec.encode(P.MsgType.PING, P.PingRequest(0)))
            return bool(sock.poll(_PROBE_S * 1000))
        except zmq.ZMQError:
            return False
        finally:
            sock.close(linger=0)
            ctx.term()

    def _adopt(self, session: Session) -> None:
        """Take the session a HELLO made; leases held from a server that restarted since are gone."""
        if self._nonce and session.nonce != self._nonce and self._held:
            log.warning(
                "the queue server at %s restarted: the %d lease(s) this client held are gone",
                self.address,
                len(self._held),
            )
            self._held.clear()
        self._nonce = session.nonce
        self._session = session

    @staticmethod
    def _progressed(err: QueueError, progressed: bool) -> QueueError:
        """A connection failure after an earlier request of the same operation got through: not safe to
        run the operation again."""
        if progressed and isinstance(err, QueueUnreachable):
            err.sent = True
        return err
