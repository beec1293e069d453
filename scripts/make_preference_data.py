"""Write the shipped preference pairs, data/preference/math_pairs_{train,test}.jsonl, from the repository's math sets.

    python scripts/make_preference_data.py [--seed 0] [--test 300] [--out data/preference]

Sources (copies in this repository, sparserl/data/eval/): GSM8K (`answer`: a worked solution ending in `#### N`) and
MATH-500 (`solution`: a worked solution whose final answer is the last `\\boxed{...}`). Each row becomes one pair:
  prompt    the problem statement (a string; the trainers apply the chat template like any prompt)
  chosen    the reference solution, unchanged
  rejected  the same solution with its final answer changed: the last number of the final answer (after `####`, or
            inside the last `\\boxed{}`) moved by a small seeded offset, preferring a value that appears nowhere else
            in the solution, so the rejected text contradicts its own working in exactly one place
MATH-500 rows whose final answer holds no digit (a letter choice, an expression) are left out. The split is a seeded
shuffle: `--test` pairs held out, the rest for training. Deterministic: the same seed writes the same bytes.
Left out on purpose: wrong answers written by a model (a sampled pair needs a rollout per row; the trainers read any
file of the same fields).
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "sparserl" / "data" / "eval"
NUMBER = re.compile(r"\d+(?:\.\d+)?")
OFFSETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20)


def last_boxed(text: str) -> tuple[int, int] | None:
    """(start, end) of the contents of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return i, j
    return None


def changed_number(value: str, solution: str, rng: random.Random) -> str:
    """`value` (digits, maybe a decimal part) moved by a seeded offset; a value absent from `solution` if one is found."""
    whole, _, frac = value.partition(".")
    n = int(whole)
    seen = set(NUMBER.findall(solution))
    candidates = []
    for off in rng.sample(OFFSETS, len(OFFSETS)):
        for sign in rng.sample((1, -1), 2):
            m = n + sign * off
            if m >= 0 and m != n:
                candidates.append(str(m) + (f".{frac}" if frac else ""))
    fresh = [c for c in candidates if c not in seen]
    return (fresh or candidates)[0]


def reject(solution: str, span: tuple[int, int], rng: random.Random) -> str | None:
    """`solution` with the last number inside `span` (its final answer) changed, or None when it holds none."""
    start, end = span
    found = list(NUMBER.finditer(solution, start, end))
    if not found:
        return None
    m = found[-1]
    return solution[: m.start()] + changed_number(m.group(), solution, rng) + solution[m.end():]


def gsm8k_pairs(seed: int) -> list[dict]:
    out = []
    for n, line in enumerate((EVAL / "gsm8k.jsonl").read_text(encoding="utf-8").splitlines()):
        row = json.loads(line)
        solution = row["answer"]
        marker = solution.rfind("#### ")
        rng = random.Random(f"{seed}:gsm8k:{n}")
        rejected = reject(solution, (marker + 5, len(solution)), rng) if marker >= 0 else None
        if rejected is not None:
            out.append({"prompt": row["question"], "chosen": solution, "rejected": rejected, "source": f"gsm8k/{n}"})
    return out


def math500_pairs(seed: int) -> list[dict]:
    out = []
    for n, line in enumerate((EVAL / "math500.jsonl").read_text(encoding="utf-8").splitlines()):
        row = json.loads(line)
        solution = row["solution"]
        span = last_boxed(solution)
        rng = random.Random(f"{seed}:math500:{n}")
        rejected = reject(solution, span, rng) if span is not None else None
        if rejected is not None:
            out.append({"prompt": row["problem"], "chosen": solution, "rejected": rejected, "source": f"math500/{n}"})
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test", type=int, default=300, help="pairs held out")
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "preference")
    args = ap.parse_args()
    pairs = gsm8k_pairs(args.seed) + math500_pairs(args.seed)
    random.Random(args.seed).shuffle(pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "math_pairs_test.jsonl", pairs[: args.test])
    write(args.out / "math_pairs_train.jsonl", pairs[args.test:])
    print(f"{len(pairs) - args.test} train and {args.test} held-out pairs in {args.out}")


if __name__ == "__main__":
    main()
