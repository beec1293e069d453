"""The lines a training run ends with on rank 0: the steps done, the reward from the start to the end, the KV cache
kept, the time, and the commands that draw the run's report and evaluate it. Read from the run's own metrics.jsonl,
so a resumed run sums up every step, not only its last segment. Plain Python: unit-testable without a run.

Left out on purpose: significance (the run report and `python -m sparserl.eval` are where a gain is judged).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

EDGE = 3  # steps averaged at each end of the reward curve: one step's 0/1 reward mean is noisy


def _rows(metrics_path: Path) -> list[dict]:
    rows: dict[int, dict] = {}
    try:
        text = metrics_path.read_text(encoding="utf-8")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > 0:
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return [rows[s] for s in sorted(rows)]


def _values(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def _ends(points: list[tuple[int, float]]) -> str:
    """'0.250 -> 0.688' with the steps each end averages."""
    k = EDGE if len(points) >= 2 * EDGE else 1
    head, tail = points[:k], points[-k:]
    mean = lambda ps: sum(v for _, v in ps) / len(ps)  # noqa: E731
    span = lambda ps: f"step {ps[0][0]}" if len(ps) == 1 else f"steps {ps[0][0]}-{ps[-1][0]}"  # noqa: E731
    return f"{mean(head):.3f} ({span(head)}) -> {mean(tail):.3f} ({span(tail)})"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s" if m else f"{s} s"


def closing_lines(out_dir: str | Path, last_step: int, total_steps: int, seconds: float, stopped: str = "") -> list[str]:
    """`stopped`: why the run ended before `total_steps` ('' when it reached it)."""
    out = Path(out_dir)
    rows = _rows(out / "metrics.jsonl")
    ended = f"{last_step} of {total_steps} steps" if not stopped else f"stopped at step {last_step} of {total_steps} ({stopped})"
    parts = [f"done: {ended} in {_duration(seconds)}"]
    rewards = _values(rows, "reward/mean")
    if rewards:
        parts.append(f"reward {_ends(rewards)}")
    kept = [v for _, v in _values(rows, "kv/retained_frac")]
    if kept:
        parts.append(f"kv kept {sum(kept) / len(kept):.1%} of a dense cache")
    folder = shlex.quote(str(out))
    lines = [" | ".join(parts),
             f"report:   python -m sparserl.report {folder}",
             f"evaluate: python -m sparserl.eval model.path={folder} 'eval.datasets=[env]'"]
    if stopped:
        lines.append(f"continue: the same command with trainer.resume=auto trainer.output_dir={folder}")
    return lines
