"""The report's curves: panels of step metrics from `metrics.jsonl`, drawn by matplotlib into one SVG.

Each panel groups a few keys of one kind (reward, length, mismatch, correction, KV, time); a panel whose keys were
never logged is left out, and a key logged only on some steps (eval rows, a correction switched on mid-way) is drawn
where it is present. Text is drawn as paths, so the SVG needs no font on the reader's machine.

Left out on purpose: smoothing (scripts/plot_metrics.py --smooth), comparing runs in one figure, and interactive
zoom (the SVG scales cleanly; metrics.jsonl holds the numbers).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

# (title, keys, y scale). The first key of a panel is drawn thickest.
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward/mean", "score/mean"), "linear"),
    ("response length (tokens)", ("response/len_mean", "response/len_max"), "linear"),
    ("mismatch: log xi = logp_old - logp_sparse", ("mismatch/abs_mean", "mismatch/k3_kl", "mismatch/kl"), "linear"),
    ("mismatch: max |log xi|", ("mismatch/abs_max",), "linear"),
    ("correction: fractions", ("correction/rejected_seq_frac", "correction/masked_low_frac",
                               "correction/masked_high_frac", "correction/truncated_frac"), "linear"),
    ("correction: IS weights", ("correction/weight_mean", "correction/weight_min", "correction/weight_max",
                                "correction/ess"), "linear"),
    ("KV cache", ("kv/retained_frac",), "linear"),
    ("time per step (s)", ("perf/step_s", "perf/rollout_s", "perf/update_s"), "linear"),
)


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl by step (the later line wins for a step logged twice); bad lines are skipped."""
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a half-written last line after a crash
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = {**by_step.get(row["step"], {}), **row}
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def panels_present(rows: list[dict]) -> list[tuple[str, list[str], str]]:
    out = []
    for title, keys, scale in PANELS:
        present = [k for k in keys if series(rows, k)[0]]
        if present:
            out.append((title, present, scale))
    return out


def curves_svg(rows: list[dict], columns: int = 4) -> str:
    """All present panels in a grid, as SVG text; raises ValueError when no panel has data."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = panels_present(rows)
    if not panels:
        raise ValueError("no known metric has a value in metrics.jsonl")
    columns = min(columns, len(panels))
    nrows = -(-len(panels) // columns)
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "sparserl-report", "font.size": 8}):
        fig = Figure(figsize=(3.4 * columns, 2.5 * nrows), layout="constrained")
        axes = fig.subplots(nrows, columns, squeeze=False)
        for ax, (title, keys, scale) in zip(axes.flat, panels):
            for i, key in enumerate(keys):
                steps, values = series(rows, key)
                marker = "o" if len(steps) < 30 else None
                ax.plot(steps, values, label=key, linewidth=2.0 if i == 0 else 1.2, marker=marker, markersize=3)
                if key == "reward/mean":
                    _, std = series(rows, "reward/std")
                    if len(std) == len(values):
                        ax.fill_between(steps, [v - s for v, s in zip(values, std)], [v + s for v, s in zip(values, std)],
                                        alpha=0.15, linewidth=0)
            ax.set_title(title)
            ax.set_yscale(scale)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="best")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()
