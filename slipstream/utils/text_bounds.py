"""Bounds on text a server is asked to tokenise, checked before the tokenizer runs.

Both servers that take text from clients (the embedded server's routes and the agent gateway) refuse a text
that certainly has too many tokens without tokenising it: tokenising megabytes takes seconds of CPU, and
a limit checked only after it costs those seconds anyway. Kept here so both roles share one definition.
"""

from __future__ import annotations

from typing import Any

_longest: dict[int, int] = {}


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string (byte-level tokens count a character per byte), so
    no token covers more characters of text than this (cached per tokenizer): a text longer than ``n`` times
    this has more than ``n`` tokens."""
    key = id(tokenizer)
    if key not in _longest:
        _longest[key] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return _longest[key]
