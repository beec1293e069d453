"""Golden metrics: the logged values of fixed-seed tiny runs, kept so that a refactor can show it changed nothing.

`check(name, rows)` compares a run's `metrics.jsonl` rows with `tests/golden/<name>.json`, bitwise on every value
but the timings (`perf/*`, `mem/*`, `kv/compress_s`, `eval/time_s`). Float results depend on the CPU's kernels and
the torch build, so a golden file records the machine it was made on (torch version, CPU capability) and is only
compared on a matching one; anywhere else the check is skipped with the reason. To record (after a change that is
meant to change numbers, said so in its commit): `SPARSERL_RECORD_GOLDEN=1 pytest tests/e2e/test_golden.py
tests/sglang/test_trainer_sglang.py`.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

from tests.metric_reads import HISTOGRAM_BIN_REL, is_histogram_read

HERE = Path(__file__).resolve().parent
TIMING_PREFIXES = ("perf/", "mem/", "kv/compress_s", "eval/time_s")


def machine() -> dict:
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine()}


def strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)} for row in rows]


def check(name: str, rows: list[dict], near: tuple[str, ...] = ()) -> None:
    """`near`: key prefixes compared within 1e-6 (absolute) instead of bitwise, for values an engine does not
    compute reproducibly (SGLang batches requests as they arrive, so its log-probs move in the last bits). Where
    `near` is given, the histogram reads among them (tests/metric_reads.py: the xi quantiles) are compared within one
    bin instead, since such last-bit noise moves them across a bin edge."""
    path = HERE / f"{name}.json"
    rows = strip(rows)
    if os.environ.get("SPARSERL_RECORD_GOLDEN") == "1":
        path.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1, sort_keys=True) + "\n")
        return
    assert path.exists(), f"no golden file {path.name}: record it with SPARSERL_RECORD_GOLDEN=1"
    golden = json.loads(path.read_text())
    if golden["machine"] != machine():
        pytest.skip(f"{path.name} was recorded on {golden['machine']}, this machine is {machine()}")
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    for got, want in zip(rows, golden["rows"]):
        assert sorted(got) == sorted(want), f"step {got['step']}: keys differ: {sorted(set(got) ^ set(want))}"
        def differs(k: str) -> bool:
            if near and k.startswith(near) and is_histogram_read(k):
                return abs(got[k] - want[k]) > HISTOGRAM_BIN_REL * max(abs(want[k]), 1.0)
            if near and k.startswith(near):
                return abs(got[k] - want[k]) > 1e-6
            return json.dumps(got[k]) != json.dumps(want[k])

        diff = {k: (got[k], want[k]) for k in want if differs(k)}
        assert not diff, f"step {got['step']} differs from {path.name} (got, golden): {diff}"
