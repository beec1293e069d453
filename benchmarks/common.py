"""Helpers shared by the benchmark scripts: machine description, prompts, table printing."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

# The eval sets ship with the package (sparserl/data/eval/README.md).
EVAL_DATA = Path(__file__).resolve().parents[1] / "sparserl" / "data" / "eval"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({cpu}), {os.cpu_count()} cores"
    return f"{dev}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def gsm8k_prompts(tokenizer, n: int, path: Path | None = None) -> list[list[int]]:
    """The first `n` GSM8K questions in the model's chat template, as token ids."""
    path = path or EVAL_DATA / "gsm8k.jsonl"
    rows = [json.loads(line) for line in open(path)][:n]
    out = []
    for r in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(f"**{title}**\n")
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text
