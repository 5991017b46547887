"""The checkpoint directory layout, in one place: names, completeness, the newest one, pruning, and the
staging directory a checkpoint is written in before it is renamed into place.

Both writers use it: the trainer on its own (``slipstream.trainer``, ``trainer.checkpoint_every``) and the
pipeline's checkpoint coordinator (``pipeline/checkpoint.py``), which adds the rollouter's state and the
queue snapshot to the same directory. Why a shared module rather than either of them: the trainer may not
import the pipeline (design.md §2), and a layout written twice drifts.

::

    <run_dir>/checkpoints/                  checkpoint_root(run_dir)
        step_00000012/                      step_dir(root, 12): complete once COMPLETE exists
            trainer_state.json              {"version": 12, "format": 1}
            COMPLETE                        written last (mark_complete)
            engine/ critic/ queue ...       whatever the writers put there
        .staging-step_00000015/             staging_dir(root, 15): a save in progress (or a crashed one)

Worked example::

    root = checkpoint_root("runs/quickstart")
    path = staging_dir(root, 12); ...write...; mark_complete(path, 12); commit(path)
    latest(root)        # PosixPath('runs/quickstart/checkpoints/step_00000012')
    prune(root, keep=2) # the two newest complete checkpoints stay; staging leftovers go
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
COMPLETE_MARKER = "COMPLETE"
STAGING = ".staging-"
FORMAT = 1


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_name(version: int) -> str:
    return f"step_{version:08d}"


def step_dir(root: str | Path, version: int) -> Path:
    """Where the checkpoint of ``version`` lives once complete."""
    return Path(root) / step_name(version)


def version_of(path: str | Path) -> int:
    """``.../step_00000012`` (or its staging directory) -> 12."""
    return int(Path(path).name.rsplit("_", 1)[1])


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def mark_complete(path: str | Path, version: int) -> None:
    """Write the trainer state, then the marker that makes ``path`` a checkpoint (always last)."""
    path = Path(path)
    (path / STATE_FILE).write_text(json.dumps({"version": version, "format": FORMAT}))
    (path / COMPLETE_MARKER).write_text("")


def read_version(path: str | Path) -> int:
    """The version a complete checkpoint holds; FileNotFoundError naming the path when it is not one."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path}: not a complete trainer checkpoint (no {COMPLETE_MARKER} marker)")
    return int(json.loads((path / STATE_FILE).read_text())["version"])


def complete(root: str | Path) -> list[Path]:
    """Every complete checkpoint under ``root``, oldest first."""
    return sorted(p for p in Path(root).glob("step_*") if is_complete(p))


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete(root)
    return found[-1] if found else None


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove staging leftovers of a crashed save."""
    root = Path(root)
    for leftover in root.glob(f"{STAGING}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for old in complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def staging_dir(root: str | Path, version: int) -> Path:
    """A fresh, empty directory to write the checkpoint of ``version`` into (see :func:`commit`)."""
    path = Path(root) / f"{STAGING}{step_name(version)}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def staging_dirs(root: str | Path) -> list[Path]:
    return sorted(Path(root).glob(f"{STAGING}step_*"))


def commit(staging: Path) -> Path:
    """Rename a written checkpoint into place (replacing an older one of the same version), durably."""
    final = staging.parent / staging.name.removeprefix(STAGING)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fd = os.open(staging.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)
    return final


__all__ = [
    "CHECKPOINTS",
    "COMPLETE_MARKER",
    "STATE_FILE",
    "checkpoint_root",
    "commit",
    "complete",
    "is_complete",
    "latest",
    "mark_complete",
    "prune",
    "read_version",
    "staging_dir",
    "step_dir",
    "version_of",
]
