"""The base every config section derives from; kept apart from `config.py` so role configs can import it
without importing the whole tree."""

from __future__ import annotations

import msgspec


class ConfigError(ValueError):
    """A configuration problem, always naming the offending key."""


class ConfigStruct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: keyword-only fields, unknown keys rejected.

    Document each field with a comment above it; cross-field rules go in ``__post_init__`` and raise
    ``ValueError`` with a message that names the field (msgspec adds the section path).
    """
