"""Where a run's metrics go: a local metrics.jsonl (always), wandb (offline by default), and the console.

The controller calls :meth:`MetricsLogger.log` once per trainer step with a flat dict of numbers whose
keys are prefixed by the part that measured them (``trainer/``, ``rollouter/``, ``queue/``, ``sync/``,
``mismatch/`` for the trainer's train–inference mismatch, and ``eval/`` for the evaluation on held-out
prompts, whose ``eval/version`` names the weights it measured).
The jsonl file is the run's record: ``slipstream plot RUN_DIR`` draws from it, and a resumed run appends to
it. The progress line shows step, reward, staleness, tokens/s and the ETA; on a terminal it is a live rich
progress bar, elsewhere (CI logs, nohup) one plain line per step.

Worked example::

    with MetricsLogger(run_dir, cfg, total_steps=40) as log:
        log.log(1, {"trainer/reward_mean": 0.12, "trainer/staleness_versions_mean": 0.4, "trainer/tokens_per_s": 210.0})
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

# Progress-line fields: the first key present in a step's metrics is shown.
PROGRESS_FIELDS: dict[str, tuple[str, ...]] = {
    "reward": ("trainer/reward_mean", "rollouter/reward_mean"),
    "staleness": ("trainer/staleness_versions_mean", "rollouter/staleness_versions_mean"),
    "tok/s": ("trainer/tokens_per_s",),
}


def pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            return float(value)
    return None


class MetricsLogger:
    """Lifecycle: create at run start, ``log`` once per step, ``close`` (or use as a context manager).

    ``cfg`` is the run's :class:`slipstream.config.Config`; its ``wandb`` section decides whether and how
    wandb logs (``offline`` writes under run_dir/wandb; ``online`` uploads; ``disabled`` skips it). With
    ``cfg`` None (a trainer rank run alone, which holds only its own settings) wandb is off.
    """

    def __init__(self, run_dir: str | Path, cfg: Any, *, total_steps: int | None = None, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self.total_steps = total_steps
        self._t0 = time.monotonic()
        self._start_step = start_step
        self._wandb = _init_wandb(self.run_dir, cfg)
        self._progress = _Progress(total_steps, start_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time_s": round(time.monotonic() - self._t0, 3)}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=step)
        self._progress.update(step, metrics)

    def close(self) -> None:
        self._progress.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl; a torn last line (a killed run) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _init_wandb(run_dir: Path, cfg: Any) -> Any:
    section = getattr(cfg, "wandb", None)
    if section is None or section.mode == "disabled":
        return None
    import msgspec
    import wandb  # a dependency of the package; imported here because it is slow to import

    return wandb.init(
        project=section.project,
        entity=section.entity,
        tags=section.tags,
        name=cfg.run.name,
        mode=section.mode,
        dir=str(run_dir),
        config=msgspec.to_builtins(cfg),  # the names users write (`async`), as config.to_dict
        resume="allow",
        id=_wandb_id(run_dir),
    )


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same wandb run."""
    id_file = run_dir / ".wandb_id"
    if not id_file.exists():
        import uuid

        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()


class _Progress:
    """A rich progress bar on a terminal; one plain line per step elsewhere."""

    def __init__(self, total: int | None, start: int):
        from rich.console import Console

        self._console = Console(stderr=True)
        self._live = self._console.is_terminal
        self._t0 = time.monotonic()
        self._start = start
        self._bar = None
        if self._live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, summary="")
            self._bar.start()
        self._total = total

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        parts = []
        for label, keys in PROGRESS_FIELDS.items():
            value = pick(metrics, keys)
            if value is not None:
                parts.append(f"{label} {value:.3g}")
        summary = "  ".join(parts)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, summary=summary)
            return
        done = step - self._start
        elapsed = time.monotonic() - self._t0
        eta = ""
        if self._total and done > 0:
            eta = f"  eta {max(0.0, elapsed / done * (self._total - step)):.0f}s"
        total = f"/{self._total}" if self._total else ""
        print(f"step {step}{total}  {summary}  elapsed {elapsed:.0f}s{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
