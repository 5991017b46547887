"""Test support: tiny random-initialised models (``utils/tiny_models.py``, where benchmarks take them from
too; nothing is ever downloaded).

Worked example::

    path = make_tiny_model(tmp_path / "tiny")
"""

from __future__ import annotations

from slipstream.utils.tiny_models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    make_tiny_model,
    make_tiny_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "make_tiny_model",
    "make_tiny_tokenizer",
]
