"""`slipstream plot RUN_DIR`: PNG curves of a run from its metrics.jsonl.

One PNG per panel (reward, staleness, idle ratios, throughput) plus ``summary.png`` with all four, written
into RUN_DIR/plots (or ``--out``). A panel draws every metric whose key matches one of its patterns, so new
metrics of the same kind appear without code changes; a panel with no data is skipped with a note.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from slipstream.metrics import read_metrics

PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("mean reward", (r"reward_mean$", r"^reward/mean$")),
    "staleness": ("staleness (versions)", (r"staleness_(mean|max)$",)),
    "idle_ratio": ("idle ratio", (r"idle_ratio$",)),
    "throughput": ("throughput", (r"tokens_per_s$", r"samples_per_s$")),
}


def series(
    records: list[dict[str, Any]], patterns: tuple[str, ...]
) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric metric whose key matches a pattern, as (steps, values)."""
    regexes = [re.compile(p) for p in patterns]
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        step = rec.get("step")
        for key, value in rec.items():
            if key == "step" or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if any(r.search(key) for r in regexes):
                steps, values = out.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    fig_all, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax_all, (name, (title, patterns)) in zip(axes.flat, PANELS.items(), strict=True):
        data = series(records, patterns)
        if not data:
            ax_all.set_title(f"{title} (no data)")
            print(f"plot: no {name} metrics in {run_dir}", file=sys.stderr)
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for target in (ax, ax_all):
            for key, (steps, values) in sorted(data.items()):
                target.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
            target.set_title(title)
            target.set_xlabel("trainer step")
            target.grid(alpha=0.3)
            target.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig_all.tight_layout()
    summary = out / "summary.png"
    fig_all.savefig(summary, dpi=110)
    plt.close(fig_all)
    written.append(summary)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slipstream plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory containing metrics.jsonl")
    parser.add_argument("--out", help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except FileNotFoundError as err:
        print(f"slipstream plot: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
