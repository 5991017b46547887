"""`slipstream plot RUN_DIR`: PNG curves of a run from its metrics.jsonl.

One PNG per panel (reward, staleness, idle ratios, throughput, evaluation, autotune, train–inference mismatch
and its importance ratios) plus ``summary.png`` with all of them, written into RUN_DIR/plots (or ``--out``).
A panel draws every metric whose key matches one of its patterns, so new metrics of the same kind appear
without code changes; a panel with no data is skipped with a note. Panels are drawn against the trainer step, except the evaluation panel: an evaluation finishes (and
is logged) a step or more after the weight version it measured, so its x axis is ``eval/version``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from slipstream.cli_args import command_parser, doc_paragraph
from slipstream.metrics import read_metrics

PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("mean reward", (r"reward_mean$", r"^reward/mean$")),
    "staleness": ("staleness (versions)", (r"staleness_versions_(mean|max)$",)),
    "idle_ratio": ("idle ratio", (r"idle_ratio$",)),
    "throughput": ("throughput", (r"tokens_per_s$", r"samples_per_s$")),
    "eval": ("evaluation on data.val_files", (r"^eval/(.+/)?(mean|pass)@\d+$",)),
    # async.autotune's setting at each decision (pipeline/autotune.py)
    "autotune": ("autotune setting", (r"^autotune/(staleness_threshold|sync_every)$",)),
    # train-inference mismatch at equal weights (trainer/mismatch.py): its size, then its importance ratios
    "mismatch": (
        "train-inference mismatch",
        (r"^mismatch/(k3|abs_diff_mean|abs_diff_max|ratio_outside)$",),
    ),
    "mismatch_ratio": ("importance ratio trainer / server", (r"^mismatch/ratio_p\d+$",)),
}
# Panels drawn against another key than the trainer step (key, axis label).
X_AXES: dict[str, tuple[str, str]] = {"eval": ("eval/version", "weight version evaluated")}
# Panels whose values span decades (a matching run's k3 is ~1e-9, a broken one's ~1): a y axis linear up to
# the threshold (so exact zeros show) and logarithmic above it.
SYMLOG_Y: dict[str, float] = {"mismatch": 1e-6}


def series(
    records: list[dict[str, Any]], patterns: tuple[str, ...], x: str = "step"
) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric metric whose key matches a pattern, as (x values, values); records without ``x`` are
    skipped."""
    regexes = [re.compile(p) for p in patterns]
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        step = rec.get(x)
        if step is None:
            continue
        for key, value in rec.items():
            if key == x or not isinstance(value, int | float) or isinstance(value, bool):
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
    rows = -(-len(PANELS) // 3)
    fig_all, axes = plt.subplots(rows, 3, figsize=(18, 4 * rows))
    for ax_spare in axes.flat[len(PANELS) :]:
        ax_spare.axis("off")
    for ax_all, (name, (title, patterns)) in zip(axes.flat, PANELS.items(), strict=False):
        x_key, x_label = X_AXES.get(name, ("step", "trainer step"))
        data = series(records, patterns, x_key)
        if not data:
            ax_all.set_title(f"{title} (no data)")
            print(f"plot: no {name} metrics in {run_dir}", file=sys.stderr)
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for target in (ax, ax_all):
            for key, (steps, values) in sorted(data.items()):
                target.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
            target.set_title(title)
            target.set_xlabel(x_label)
            if name in SYMLOG_Y:
                target.set_yscale("symlog", linthresh=SYMLOG_Y[name])
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
    parser = command_parser("slipstream plot", doc_paragraph(__doc__))
    # Hand-written: a run directory and where the PNGs go, no config key.
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
