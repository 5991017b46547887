"""What the receiving side of a weight push needs from the process that serves the weights.

The embedded inference server (rollouter/) implements :class:`WeightTarget`; the checkpoint engine's HTTP
receiver (``weightsync/http_receiver.py``) stages a whole version through it and applies it at once, so a
transfer cut short never leaves a half-updated model serving. weightsync imports no other role: it only
knows this protocol.

Lifecycle of one version on a target::

    specs = target.weight_specs()            # names, shapes and dtypes the target accepts
    ... receive every tensor of version v into a staging area, checking it against specs ...
    target.apply_weights(staged.items(), v)  # atomic: generation paused, all copied in, version = v
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightTarget(Protocol):
    @property
    def weight_version(self) -> int:
        """The version now serving (the one stamped on newly generated tokens)."""
        ...

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter the target accepts, by (HF) name: its full shape and dtype."""
        ...

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy the tensors in and set ``weight_version = version``, all with generation paused.

        Raises (and leaves the old weights serving) when a name is unknown or a shape does not match.
        If generation was already paused (``/pause_generation``) it stays paused; otherwise the update
        runs under an in-place pause and generation resumes afterwards.
        """
        ...
