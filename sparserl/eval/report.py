"""Evaluation outputs: `eval.json` (settings and per-set metrics), `samples.jsonl` (one line per sample) and
the table printed at the end.

Both files are written to a temporary name and renamed, so a folder never holds half a result.
Left out on purpose: HTML reports and plots (the JSON has everything a plot needs).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from sparserl.config import Config
from sparserl.eval.run import EvalResult

_COLUMNS = (("avg@", "{:.3f}"), ("pass@", "{:.3f}"), ("maj@", "{:.3f}"), ("response_len", "{:.1f}"),
            ("truncated_frac", "{:.3f}"), ("kv_retained_frac", "{:.3f}"), ("kv_peak_tokens", "{:.1f}"),
            ("kv_peak_mib", "{:.2f}"))


def settings(cfg: Config, model: str, world_size: int) -> dict[str, Any]:
    """What eval.json records next to the numbers: the model, eval.*, the engine and its KV settings."""
    return {"model": model, "world_size": world_size, "eval": dataclasses.asdict(cfg.eval),
            "rollout": {"engine": cfg.rollout.engine, "dtype": cfg.rollout.dtype, "kv": dataclasses.asdict(cfg.rollout.kv)}}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(out_dir: str | Path, result: EvalResult, settings: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**settings, "datasets": result.metrics, "seconds": result.seconds}
    _atomic_write(out / "eval.json", json.dumps(summary, indent=2) + "\n")
    lines = (json.dumps(dataclasses.asdict(r), ensure_ascii=False) + "\n" for recs in result.records.values() for r in recs)
    _atomic_write(out / "samples.jsonl", "".join(lines))
    return out


def _column_keys(metrics: dict[str, float]) -> list[str]:
    """The table's metric columns in a fixed order (pass@k by k); the rest (kv_peak_tokens_max) stays in the JSON."""
    keys = []
    for prefix, _ in _COLUMNS:
        found = [k for k in metrics if k == prefix or (prefix.endswith("@") and k.startswith(prefix))]
        keys += sorted(found, key=lambda k: int(k.split("@")[1]) if "@" in k else 0)
    return keys


def format_table(result: EvalResult, title: str = "") -> str:
    """A markdown table: one row per set, one column per metric."""
    keys: list[str] = []
    for m in result.metrics.values():
        keys += [k for k in _column_keys(m) if k not in keys]
    fmt = {k: next(f for p, f in _COLUMNS if k == p or (p.endswith("@") and k.startswith(p))) for k in keys}
    header = ["dataset", "prompts", *keys, "s"]
    rows = [[name, str(int(m["prompts"])), *(fmt[k].format(m[k]) if k in m else "-" for k in keys),
             f"{result.seconds.get(name, 0.0):.1f}"] for name, m in result.metrics.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    text = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    return "\n".join(([title] if title else []) + text)
