"""The report's curves: panels of step metrics from `metrics.jsonl`, drawn by matplotlib into one SVG.

Each panel groups a few keys of one kind (reward, length, the actor's update, mismatch, correction, KV, memory,
evaluation, time); a panel whose keys were never logged is left out, and a key logged only on some steps (eval rows,
a correction switched on mid-way) is drawn where it is present. A panel of shares (fractions of sequences, tokens or
a dense cache) has a fixed [0, 1] axis, so a flat line at 1 stays flat instead of being stretched over an
auto-scaled 0.96-1.04. The reward's ±std band is kept inside [0, 1] when every step's mean and std are those of
rewards in [0, 1] (the Bhatia-Davis bound std^2 <= mean (1 - mean)), as for a 0/1 reward; `score/mean` is left out
where it equals `reward/mean` at every step, as any key whose curve an earlier key of its panel already draws (the
legend names it: `actor/loss (= actor/pg_loss)` without a KL or entropy term, `avg@1 (= pass@1, maj@1)` with one
sample). Text is drawn as paths, so the SVG needs no font on the reader's machine.

Left out on purpose: smoothing (scripts/plot_metrics.py --smooth), comparing runs in one figure, and interactive
zoom (the SVG scales cleanly; metrics.jsonl holds the numbers).
"""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # drawn in this order, the first thickest
    share: bool = False  # values in [0, 1]: a fixed [0, 1] axis
    pattern: str = ""  # a regex: every logged key that matches it is drawn as well (phases, eval sets)
    scale: str = "linear"
    from_zero: bool = False  # an amount (GB, seconds): the axis starts at 0, so a few bytes' change stays small


PANELS: tuple[Panel, ...] = (
    Panel("reward", ("reward/mean", "score/mean")),
    Panel("response length (tokens)", ("response/len_mean", "response/len_max")),
    Panel("actor: loss", ("actor/loss", "actor/pg_loss", "actor/kl")),
    Panel("actor: entropy (nats per token)", ("actor/entropy",)),
    Panel("actor: clipped token shares", ("actor/clip_frac", "actor/clip_frac_low", "actor/clip_frac_high",
                                          "actor/dual_clip_frac"), share=True),
    Panel("actor: grad norm (before clipping)", ("actor/grad_norm",)),
    Panel("mismatch: log xi = logp_old - logp_sparse", ("mismatch/abs_mean", "mismatch/k3_kl", "mismatch/kl")),
    Panel("mismatch: max |log xi|", ("mismatch/abs_max",)),
    Panel("correction: shares", ("correction/rejected_seq_frac", "correction/masked_low_frac",
                                 "correction/masked_high_frac", "correction/truncated_frac"), share=True),
    Panel("correction: IS weights", ("correction/weight_mean", "correction/weight_min", "correction/weight_max",
                                     "correction/ess")),
    Panel("KV cache kept (share of a dense cache)", ("kv/retained_frac",), share=True),
    Panel("memory per process (GB)", ("mem/peak_gb", "mem/rss_gb"), from_zero=True),
    Panel("KV cache: peak memory (GB)", ("kv/peak_gb",), from_zero=True),
    Panel("memory peak per phase (GB)", (), pattern=r"^mem/(?!peak_gb)\w+_peak_gb$", from_zero=True),
    Panel("evaluation (share correct)", (), share=True, pattern=r"^eval/[^/]+/(avg|pass|maj)@\d+$"),
    Panel("time per step (s)", ("perf/step_s", "perf/rollout_s", "perf/update_s"), from_zero=True),
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


def _keys(panel: Panel, rows: list[dict]) -> list[str]:
    keys = [k for k in panel.keys if series(rows, k)[0]]
    if panel.pattern:
        found = sorted({k for r in rows for k in r if re.match(panel.pattern, k) and k not in keys})
        keys += [k for k in found if series(rows, k)[0]]
    return keys


def same_series(rows: list[dict], a: str, b: str) -> bool:
    """Whether keys `a` and `b` hold the same value at every step either is logged."""
    return series(rows, a) == series(rows, b)


def panels_present(rows: list[dict]) -> list[tuple[Panel, list[str]]]:
    """Each panel with data and its keys; a key whose curve equals an earlier key's of the panel is left out
    (`same_as` names it in the legend)."""
    out = []
    for panel in PANELS:
        keys = _keys(panel, rows)
        keys = [k for i, k in enumerate(keys) if not any(same_series(rows, j, k) for j in keys[:i])]
        if keys:
            out.append((panel, keys))
    return out


def same_as(panel: Panel, keys: list[str], key: str, rows: list[dict]) -> list[str]:
    """The panel's keys left out because their curve is `key`'s."""
    return [k for k in _keys(panel, rows) if k not in keys and same_series(rows, key, k)]


def reward_band(rows: list[dict]) -> tuple[list[int], list[float], list[float]] | None:
    """reward/mean ± reward/std per step, inside [0, 1] when every step is consistent with rewards in [0, 1]."""
    pts = [(r["step"], float(r["reward/mean"]), float(r["reward/std"])) for r in rows
           if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for k in ("reward/mean", "reward/std"))]
    if not pts:
        return None
    bounded = all(0.0 <= m <= 1.0 and s * s <= m * (1.0 - m) + 1e-9 for _, m, s in pts)
    lo, hi = (0.0, 1.0) if bounded else (float("-inf"), float("inf"))
    return ([p[0] for p in pts], [max(lo, m - s) for _, m, s in pts], [min(hi, m + s) for _, m, s in pts])


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
        for ax, (panel, keys) in zip(axes.flat, panels):
            for i, key in enumerate(keys):
                steps, values = series(rows, key)
                marker = "o" if len(steps) < 30 else None
                twins = same_as(panel, keys, key, rows)
                label = f"{key} (= {', '.join(twins)})" if twins else key
                ax.plot(steps, values, label=label, linewidth=2.0 if i == 0 else 1.2, marker=marker, markersize=3)
                if key == "reward/mean":
                    band = reward_band(rows)
                    if band is not None:
                        ax.fill_between(band[0], band[1], band[2], alpha=0.15, linewidth=0, label="± std")
            ax.set_title(panel.title)
            ax.set_yscale(panel.scale)
            if panel.share:
                ax.set_ylim(-0.02, 1.02)
            elif panel.from_zero:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="best")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()
