"""The errors queue clients raise (their own module, so transports and operations can share them)."""

from __future__ import annotations


class QueueError(RuntimeError):
    """A queue request failed: the server refused it (the message says why) or did not answer in time."""


class QueueFull(QueueError):
    """A put waited ``timeout_s`` on back-pressure and the queue still had no room."""
