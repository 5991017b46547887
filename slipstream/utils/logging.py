"""One logging format for every process of a run, so interleaved logs stay readable."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname).1s %(process)d %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger under the `slipstream` hierarchy; the level comes from SLIPSTREAM_LOG_LEVEL (INFO)."""
    root = logging.getLogger("slipstream")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SLIPSTREAM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name if name.startswith("slipstream") else f"slipstream.{name}")
