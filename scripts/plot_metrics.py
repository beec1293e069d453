"""Plot one metric against step for one or more runs.

    python scripts/plot_metrics.py runs/dense runs/rkv --key reward/mean --out reward.png \
        --labels dense rkv --smooth 5

Each RUN_DIR holds a `metrics.jsonl` (a path to the file itself works too). Steps where the key is missing
or null (NaN when logged) are skipped; if a step appears twice (a resume without truncation), the later
line wins. With `--smooth k > 1` a trailing moving average over k points is drawn on top of the raw curve,
which stays visible but faint.

Left out on purpose: several keys per figure, subplots, log scales and interactive display; run the script
once per key.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from sparserl.utils.errors import UserError, run_main  # noqa: E402
from sparserl.utils.runs import follow_latest  # noqa: E402


def read_metric(run_dir: str | Path, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in a run's metrics.jsonl, sorted by step."""
    path = follow_latest(run_dir)  # a folder of runs (outputs/grpo): its newest run
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass run directories that contain metrics.jsonl")
    by_step: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a half-written last line after a crash
            continue
        value = row.get(key) if isinstance(row, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(row.get("step"), int):
            by_step[row["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start, so no point is lost)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: list[str | Path], key: str, out: str | Path, labels: list[str] | None = None,
              smooth: int = 1, title: str | None = None, max_step: int | None = None) -> Path:
    """Draw `key` vs step, one line per run (steps up to `max_step` when given), and save a PNG to `out`;
    returns the output path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays untouched

    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(f"--labels has {len(labels)} names for {len(run_dirs)} runs")
    if smooth < 1:
        raise UserError(f"--smooth must be >= 1, got {smooth}")
    labels = labels or [(p if p.is_dir() else p.parent).name for p in (Path(d).resolve() for d in run_dirs)]

    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    plotted = 0
    for run_dir, label in zip(run_dirs, labels):
        steps, values = read_metric(run_dir, key)
        if max_step is not None:
            values = [v for s, v in zip(steps, values) if s <= max_step]
            steps = [s for s in steps if s <= max_step]
        if not steps:
            print(f"warning: {run_dir} has no values for {key!r}", file=sys.stderr)
            continue
        if smooth > 1:
            (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(values, smooth), color=raw.get_color(), linewidth=1.8, label=label)
        else:
            ax.plot(steps, values, linewidth=1.5, label=label)
        plotted += 1
    if plotted == 0:
        raise UserError(f"no run has values for {key!r}")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or (key if smooth == 1 else f"{key} (moving average over {smooth})"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a metric from metrics.jsonl against step.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--key", default="reward/mean")
    parser.add_argument("--out", required=True, help="PNG path to write")
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window (1: none)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--max-step", type=int, default=None, help="plot steps up to this one only")
    args = parser.parse_args(argv)
    out = plot_runs(args.run_dirs, args.key, args.out, labels=args.labels, smooth=args.smooth, title=args.title,
                    max_step=args.max_step)
    print(out)


if __name__ == "__main__":
    run_main(main)
