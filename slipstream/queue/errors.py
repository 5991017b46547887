"""The errors queue clients raise (their own module, so transports and operations can share them)."""

from __future__ import annotations


class QueueError(RuntimeError):
    """A queue request failed: the server refused it (the message says why) or did not answer in time."""


class QueueFull(QueueError):
    """A put waited ``timeout_s`` on back-pressure and the queue still had no room."""


class QueueUnreachable(QueueError):
    """The connection to the server broke or no reply came in time; the client reconnects on its next call.

    ``sent`` is False when nothing of the failed operation reached the server (the connection was already
    broken), so the client may run the operation again on a fresh connection without doing anything twice.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent
