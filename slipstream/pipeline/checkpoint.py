"""Run checkpoints that hold every part consistently (:class:`CheckpointCoordinator`), and the per-step
record of trained samples.

A checkpoint is one directory ``<run_dir>/checkpoints/step_<version>`` holding, written in this order:

1. ``rollouter.json``: the rollouter's prompt position, gate count and every prompt owed but not yet put
   (groups in flight, dropped groups waiting to be generated again);
2. ``queue``: the queue snapshot (unconsumed and leased groups, consumed ids, dropped list);
3. ``engine/`` and ``trainer_state.json``: the trainer's weights, optimizer and version, then its
   ``COMPLETE`` marker (``Trainer.save`` writes 2 and 3).

With ``async.autotune`` on, ``autotune.msgpack`` (the controller's :class:`AutotuneState`) is written with
``rollouter.json``, so a resumed run goes on from the controller's setting and memory.

Why this order: the rollouter keeps generating while the trainer saves. A group put after step 1 is both
owed in ``rollouter.json`` and held in the snapshot; a resumed run generates it again and the queue refuses
the copy (its group id was seen). Taking the snapshot first would instead lose a group put between the two.
The trainer is between steps, so the snapshot's consumed set is exactly what the saved weights have seen.

Everything is written into ``.staging-step_<version>`` and renamed into place, so a checkpoint exists whole
or not at all; :func:`slipstream.utils.checkpoints.latest` only sees renamed, complete ones. The directory
layout itself (names, the ``COMPLETE`` marker, pruning, staging) is ``slipstream.utils.checkpoints``, which
the trainer's own checkpoints use too; this module adds what only a whole run holds.

``trained_uids.jsonl`` (``run.record_uids``) has one line per trainer step, ``{"step": s, "uids": [...]}``.
After a restart from checkpoint ``c`` the steps after ``c`` are trained again and recorded again; the last
record of a step is the one that counts (:func:`read_trained_uids`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from slipstream.pipeline.autotune import Autotuner, AutotuneState
from slipstream.rollouter.state import RolloutState
from slipstream.utils import checkpoints as layout
from slipstream.utils.checkpoints import checkpoint_root, commit, latest, prune, staging_dir
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.pipeline.parts import Parts

log = get_logger(__name__)

ROLLOUTER_STATE = "rollouter.json"
AUTOTUNE_STATE = "autotune.msgpack"
UIDS_FILE = "trained_uids.jsonl"


def write_rollouter_state(staging: Path, state: RolloutState) -> None:
    (staging / ROLLOUTER_STATE).write_bytes(state.encode())


def read_rollouter_state(checkpoint: Path) -> RolloutState | None:
    """The rollouter's state saved in ``checkpoint`` (None when it holds none: a trainer-only checkpoint).
    Checkpoints written before the state was a Struct decode as they are (``rollouter/state.py``)."""
    path = checkpoint / ROLLOUTER_STATE
    return RolloutState.decode(path.read_bytes()) if path.is_file() else None


def read_autotune_state(checkpoint: Path) -> AutotuneState | None:
    """The autotune controller's state saved in ``checkpoint`` (None when the run had it off)."""
    path = checkpoint / AUTOTUNE_STATE
    return msgspec.msgpack.decode(path.read_bytes(), type=AutotuneState) if path.is_file() else None


def salvage(root: Path) -> Path | None:
    """Complete a save that died after its queue snapshot; return it (None when there is none).

    Why: writing the snapshot commits the queue's journal, so a live queue can no longer roll back past it.
    ``Trainer.save`` writes the engine, then the snapshot, then ``trainer_state.json`` and ``COMPLETE``; a
    staging directory holding the snapshot therefore holds a whole engine checkpoint and lacks only those
    two small files, whose content the directory name gives. A trainer restarted on the live queue must
    resume from it, not from the previous checkpoint.
    """
    found = None
    for staging in layout.staging_dirs(root):
        if (staging / "queue").is_file() and (staging / ROLLOUTER_STATE).is_file():
            layout.mark_complete(staging, layout.version_of(staging))
            found = commit(staging)
    return found


class CheckpointCoordinator:
    """Writes run checkpoints in the order of the module docstring and finds the one to resume from.

    Lifecycle: ``resume_point()`` once at start-up (before the trainer ranks exist), then ``save(version)``
    between steps, every ``trainer.checkpoint_every`` steps and at the end of a run.
    """

    def __init__(self, parts: Parts, run_dir: Path, *, keep: int, save_timeout_s: float) -> None:
        self.parts = parts
        self.run_dir = run_dir
        self.root = checkpoint_root(run_dir)
        self.keep = keep
        self.save_timeout_s = save_timeout_s
        self.autotune: Autotuner | None = None  # the step driver's controller, saved with the rollouter

    def resume_point(self, resume: bool) -> Path | None:
        """The checkpoint to resume from (None: a fresh start, with ``run.resume`` off or none written).
        Staging leftovers of a crashed save go first; a fresh start drops the old trained-uids record."""
        if self.root.is_dir():
            prune(self.root, self.keep)
        found = latest(self.root) if resume else None
        if found is not None:
            log.info("resuming from %s", found)
        elif (self.run_dir / UIDS_FILE).exists():
            (self.run_dir / UIDS_FILE).unlink()  # a fresh start: an older record would mislead
        return found

    def save(self, version: int) -> dict[str, float]:
        """Rollouter state, then the trainer ranks' save (engine, queue snapshot, marker), then the rename."""
        t0 = time.monotonic()
        staging = staging_dir(self.root, version)
        write_rollouter_state(staging, self.parts.rollouter.state_dict())
        if self.autotune is not None:
            (staging / AUTOTUNE_STATE).write_bytes(msgspec.msgpack.encode(self.autotune.state))
        self.parts.trainer.save(str(staging), self.save_timeout_s)
        final = commit(staging)
        prune(self.root, self.keep)
        log.info("checkpoint of version %d in %s (%.1f s)", version, final, time.monotonic() - t0)
        return {"ckpt/save_s": time.monotonic() - t0}


def record_uids(run_dir: str | Path, step: int, uids: list[str]) -> None:
    with (Path(run_dir) / UIDS_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "uids": uids}) + "\n")


def read_trained_uids(run_dir: str | Path) -> dict[int, list[str]]:
    """Step -> the uids it trained on, the last record of each step winning (see the module docstring)."""
    path = Path(run_dir) / UIDS_FILE
    steps: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        steps[int(rec["step"])] = list(rec["uids"])
    return dict(sorted(steps.items()))


__all__ = [
    "CheckpointCoordinator",
    "read_autotune_state",
    "checkpoint_root",
    "commit",
    "latest",
    "prune",
    "read_rollouter_state",
    "read_trained_uids",
    "record_uids",
    "salvage",
    "staging_dir",
    "write_rollouter_state",
]
