"""Errors of a weight transfer. Every one of them means: this version did not arrive, the old one serves."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer was cut short (a peer died, a wait timed out, a payload did not match its metadata).

    Whoever sees it discards what it staged for that version and tears the group down; the weights that
    were serving before keep serving.
    """


class TransferAborted(TransferError):
    """The sender gave up on a version on purpose (its tensor iterator raised) and said so."""


class SourceFailed(TransferError):
    """The sender's own side failed mid-version (its tensor iterator raised, packing ran out of memory),
    not the wire: receivers were told to drop the version. The original error is ``__cause__``; a caller
    that must not mistake a bug for a lost push (the publisher) raises that one."""
