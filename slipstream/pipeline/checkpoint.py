"""Run checkpoints that hold every part consistently, and the per-step record of trained samples.

A checkpoint is one directory ``<run_dir>/checkpoints/step_<version>`` holding, written in this order:

1. ``rollouter.json``: the rollouter's prompt position, gate count and every prompt owed but not yet put
   (groups in flight, dropped groups waiting to be generated again);
2. ``queue``: the queue snapshot (unconsumed and leased groups, consumed ids, dropped list);
3. ``engine/`` and ``trainer_state.json``: the trainer's weights, optimizer and version, then its
   ``COMPLETE`` marker (``Trainer.save`` writes 2 and 3).

Why this order: the rollouter keeps generating while the trainer saves. A group put after step 1 is both
owed in ``rollouter.json`` and held in the snapshot; a resumed run generates it again and the queue refuses
the copy (its group id was seen). Taking the snapshot first would instead lose a group put between the two.
The trainer is between steps, so the snapshot's consumed set is exactly what the saved weights have seen.

Everything is written into ``.staging-step_<version>`` and renamed into place, so a checkpoint exists whole
or not at all; :func:`slipstream.trainer.trainer.latest_checkpoint` only sees renamed, complete ones.

``trained_uids.jsonl`` (``run.record_uids``) has one line per trainer step, ``{"step": s, "uids": [...]}``.
After a restart from checkpoint ``c`` the steps after ``c`` are trained again and recorded again; the last
record of a step is the one that counts (:func:`read_trained_uids`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
ROLLOUTER_STATE = "rollouter.json"
UIDS_FILE = "trained_uids.jsonl"
_STAGING = ".staging-"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def staging_dir(root: Path, version: int) -> Path:
    """A fresh, empty directory to write the checkpoint of ``version`` into."""
    path = root / f"{_STAGING}step_{version:08d}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def write_rollouter_state(staging: Path, state: dict[str, Any]) -> None:
    (staging / ROLLOUTER_STATE).write_text(json.dumps(state))


def read_rollouter_state(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / ROLLOUTER_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def commit(staging: Path) -> Path:
    """Rename a written checkpoint into place (replacing an older one of the same version)."""
    final = staging.parent / staging.name.removeprefix(_STAGING)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fd = os.open(staging.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)
    return final


def salvage(root: Path) -> Path | None:
    """Complete a save that died after its queue snapshot; return it (None when there is none).

    Why: writing the snapshot commits the queue's journal, so a live queue can no longer roll back past it.
    ``Trainer.save`` writes the engine, then the snapshot, then ``trainer_state.json`` and ``COMPLETE``; a
    staging directory holding the snapshot therefore holds a whole engine checkpoint and lacks only those
    two small files, whose content the directory name gives. A trainer restarted on the live queue must
    resume from it, not from the previous checkpoint.
    """
    from slipstream.trainer.trainer import COMPLETE_MARKER, STATE_FILE

    found = None
    for staging in sorted(root.glob(f"{_STAGING}step_*")):
        if (staging / "queue").is_file() and (staging / ROLLOUTER_STATE).is_file():
            version = int(staging.name.rsplit("_", 1)[1])
            (staging / STATE_FILE).write_text(json.dumps({"version": version, "format": 1}))
            (staging / COMPLETE_MARKER).write_text("")
            found = commit(staging)
    return found


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove staging leftovers of a crashed save."""
    from slipstream.trainer.trainer import COMPLETE_MARKER

    for leftover in root.glob(f"{_STAGING}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete = sorted(p for p in root.glob("step_*") if (p / COMPLETE_MARKER).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


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
