"""Staleness in weight versions: the one formula the trainer's cap, the rollouter's metrics and the
``async`` config count with, kept here so every role can import it."""

from __future__ import annotations


def versions_behind(trainer_step: int, min_version: int, sync_every: int) -> int:
    """Weight versions (pushes, one every ``sync_every`` steps) between tokens stamped ``min_version`` and the
    trainer at ``trainer_step``: the staleness every cap and metric counts."""
    return max(0, trainer_step - min_version) // sync_every
