"""The rollouter's saved state: where the prompt source stands, the staleness gate's count, and every
prompt owed but not yet put (groups in flight, a prompt waiting for the gate, groups the trainer dropped).

A run checkpoint stores it as ``rollouter.json`` (``pipeline/checkpoint.py``). Owed prompts are
``array_like`` Structs, so the file keeps the compact form earlier checkpoints were written in
(``"pending": [[epoch, index, attempt, resamples], ...]``; checkpoints older still lack ``resamples``) and
both decode into these types: resuming an existing run needs no conversion.

Worked example::

    state = RolloutState(prompts=PromptPosition(epoch=0, offset=5, seed=0, shuffle=False, size=12),
                         gate=GateCount(admitted=3), pending=[PendingPrompt(0, 4)])
    RolloutState.decode(state.encode()) == state      # True
"""

from __future__ import annotations

from typing import Any

import msgspec


class PromptPosition(msgspec.Struct, frozen=True, gc=False):
    """The prompt source's position (``PromptSource.state_dict``): the next prompt is ``offset`` in the
    order of ``epoch``; ``seed``, ``shuffle`` and ``size`` guard against resuming on other data."""

    epoch: int
    offset: int
    seed: int
    shuffle: bool
    size: int

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class GateCount(msgspec.Struct, frozen=True, gc=False):
    """The staleness gate's count of admitted groups, and the units given back by groups that ended
    without reaching the queue."""

    admitted: int
    refunded: int = 0

    def as_dict(self) -> dict[str, int]:
        return msgspec.structs.asdict(self)


class PendingPrompt(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A prompt owed a group: prompt ``index`` of ``epoch``, at its ``attempt``-th re-generation after a
    drop and ``resamples``-th after dynamic sampling discarded a group of equal scores."""

    epoch: int
    index: int
    attempt: int = 0
    resamples: int = 0


class RolloutState(msgspec.Struct, frozen=True, gc=False):
    prompts: PromptPosition
    gate: GateCount
    pending: list[PendingPrompt] = []

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> RolloutState:
        return msgspec.json.decode(data, type=cls)


__all__ = ["GateCount", "PendingPrompt", "PromptPosition", "RolloutState"]
