"""Side-by-side table of `python -m sparserl.eval` runs (docs/evaluation.md), with one diagnostic column.

    python benchmarks/eval_table.py outputs/eval_smollm2/dense outputs/eval_smollm2/rkv128

Reads each run's eval.json and samples.jsonl. Besides the command's own metrics it prints, as a diagnostic only,
how often the last number in a response equals the answer and how often a response contains `\\boxed`: for a
model that rarely boxes its answer these say whether a score of 0 comes from the answer format.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except (TypeError, ValueError):
        return False


def rows(run: Path) -> list[str]:
    summary = json.loads((run / "eval.json").read_text())
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    kv = summary["rollout"]["kv"]
    label = "dense" if kv["algorithm"] == "none" else f"{kv['algorithm']}, budget {kv['budget']}"
    out = []
    for name, m in summary["datasets"].items():
        mine = [r for r in records if r["dataset"] == name]
        lenient = sum(same_number(last_number(r["response"]), r["answer"]) for r in mine) / len(mine)
        boxed = sum("\\boxed" in r["response"] for r in mine) / len(mine)
        out.append(f"| {name} | {label} | {m['avg@4']:.3f} | {m['pass@4']:.3f} | {m['maj@4']:.3f} | {lenient:.3f} | "
                   f"{boxed:.2f} | {m['response_len']:.0f} | {m['truncated_frac']:.3f} | {m['kv_retained_frac']:.3f} | "
                   f"{m['kv_peak_tokens']:.0f} ({m['kv_peak_mib']:.1f} MiB) | {summary['seconds'][name]:.0f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="eval.output_dir folders")
    args = ap.parse_args()
    print("| set | KV | avg@4 | pass@4 | maj@4 | last number = answer | has \\boxed | response tokens | truncated | "
          "KV retained | peak KV / seq | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in args.runs:
        print("\n".join(rows(run)))


if __name__ == "__main__":
    main()
