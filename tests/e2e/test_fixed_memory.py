"""`benchmarks/fixed_memory.py --quick` end to end on a tiny random model: every row of the table, its rollout and
training numbers, the keyed-draw check and the goals; the rows' commands and the tables' pure parts."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import driver

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LABELS = ("dense, reservation", "dense, optimistic", "SGLang dense", "R-KV tail", "int8 KV", "R-KV tail + int8 KV")


def _rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and not set(cells[0]) <= {"-"} and cells[0] != "config":
            rows[re.sub(r" \(.*\)$", "", cells[0])] = cells
    return rows


@pytest.mark.slow
def test_quick_table_has_every_row_with_sane_numbers(tiny_checkpoint, tmp_path):
    out = tmp_path / "fm"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    res = subprocess.run(driver(tmp_path, "benchmarks/fixed_memory.py") + ["--quick", "--model", str(tiny_checkpoint),
                                                                           "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    text = (out / "table.md").read_text()
    rows = _rows(text.split("\n\n", 2)[1])
    assert set(rows) == set(LABELS), rows.keys()
    assert rows["SGLang dense"][1].startswith("not run under --quick")
    results = json.loads((out / "results.json").read_text())
    from benchmarks.fixed_memory import kv_dtype_missing

    measured = ["dense_reserve", "dense_optimistic", "rkv_tail"] + ([] if kv_dtype_missing() else ["int8", "rkv_int8"])
    for name in measured:
        r = results[name]
        assert r["tok_s"] > 0 and r["new_tokens"] == 4 * 4 * 24  # a random model runs every sample to its length
        assert 1 <= r["mean_running"] <= r["peak_running"] <= 16
        assert 0 < r["peak_kv_bytes"] <= r["pool_slots"] * r["bytes_per_slot"]
        assert r["step_s"] > 0 and r["rollout_s"] > 0 and 0 < r["xi_p05"] <= 1.5 and 0 <= r["rejected"] <= 1
        assert len(r["budgets"]) == 3
    pool = results["dense_reserve"]["pool_slots"] * results["dense_reserve"]["bytes_per_slot"]
    for name in measured:  # one KV memory in bytes for every row, whatever an entry costs
        assert abs(results[name]["pool_slots"] * results[name]["bytes_per_slot"] - pool) < results[name]["bytes_per_slot"]
    assert results["dense_reserve"]["retractions"] == 0 and results["dense_reserve"]["peak_running"] <= 4
    assert results["rkv_tail"]["kept"] < 1.0 and results["dense_optimistic"]["kept"] == 1.0
    assert all(40 <= b <= 64 for b in results["rkv_tail"]["budgets"])  # the quick controller's range
    if not kv_dtype_missing():
        assert results["int8"]["pool_slots"] > 2 * results["dense_optimistic"]["pool_slots"]
    else:
        assert rows["int8 KV"][1].startswith("not available")
    draws = [line for line in text.splitlines() if line.startswith("keyed draw across pool sizes")]
    # the draw is keyed by (seed, prompt, sample, position): neither the pool nor the schedule changes a token
    assert len(draws) == 2 and all(": 8/8 sequences with the same token ids" in d for d in draws), draws
    assert re.search(r"keyed draw across schedules, .*: 16/16 sequences with the same token ids", text)
    for goal in ("rollout throughput", "step time", "sequences running", "dense reservation", "SGLang dense"):
        assert goal in text
    assert "machine: CPU" in text or "machine: NVIDIA" in text


def test_rows_differ_only_where_they_should(tmp_path, capsys):
    from benchmarks import fixed_memory as fm

    args = fm.parse_args(["--out", str(tmp_path)])
    t = fm.task_args(args, tmp_path)
    data = tmp_path / "prompts.jsonl"
    cmds = {r.name: fm.row_overrides(r, t, "M", data, tmp_path / r.name, "150000KB") for r in fm.ROWS}

    def keys(cmd, prefix):
        return [a for a in cmd if a.startswith(prefix)]

    for name, cmd in cmds.items():
        assert "rollout.kv_memory=150000KB" in cmd and "env.path=envs/cycle_walk.py" in cmd
        assert "rollout.max_new_tokens=340" in cmd and "rollout.n=8" in cmd and "trainer.total_steps=3" in cmd
        assert "trainer.prompts_per_step=32" in cmd and "model.compute_dtype=float32" in cmd
        assert "rollout.kv.compress_prompt=false" in cmd and "rollout.kv.variant=reference" in cmd
    assert keys(cmds["dense_reserve"], "rollout.admission=") == ["rollout.admission=reserve"]
    assert keys(cmds["dense_optimistic"], "rollout.admission=") == ["rollout.admission=optimistic"]
    assert "+preset=dense" in cmds["sglang_dense"] and "rollout.engine=sglang" in cmds["sglang_dense"]
    for name in ("rkv_tail", "rkv_int8"):
        assert "+preset=sparse_rl" in cmds[name] and keys(cmds[name], "rollout.kv.control.") == [
            "rollout.kv.control.floor=80", "rollout.kv.control.ceiling=120"]
    assert "rollout.kv_dtype=int8" in cmds["int8"] and "+preset=dense" in cmds["int8"]
    strip = lambda c: [a for a in c if not a.startswith(("trainer.output_dir=", "rollout.kv_dtype="))]  # noqa: E731
    assert strip(cmds["rkv_int8"]) == strip(cmds["rkv_tail"]) and strip(cmds["int8"]) == strip(cmds["dense_optimistic"])
    for cmd in cmds.values():  # every command loads as a config (int8 rows once the key exists)
        if "rollout.kv_dtype=int8" not in cmd or not fm.kv_dtype_missing():
            fm.load_row_config([a.replace("model.path=M", f"model.path={tmp_path}") for a in cmd])
    assert shlex.join(cmds["dense_optimistic"])


def test_goals_and_bitwise_lines():
    from benchmarks.fixed_memory import bitwise_line, goals

    results = {"dense_optimistic": {"tok_s": 10.0, "step_s": 30.0, "mean_running": 8.0},
               "dense_reserve": {"tok_s": 12.0}, "rkv_tail": {"tok_s": 30.0, "step_s": 20.0, "mean_running": 20.0,
                                                              "rejected": 0.05},
               "rkv_int8": {"tok_s": 50.0, "step_s": 15.0, "mean_running": 40.0, "rejected": 0.1},
               "sglang_dense": {"error": "not available"}}
    text = "\n".join(goals(results))
    assert "throughput: 3.00x (met" in text and "step time (dense / R-KV): 1.50x (met" in text
    assert "sequences running (mean): 2.00x (met" in text
    assert "dense reservation, rollout throughput: 0.83x (not met" in text
    assert "SGLang dense, rollout throughput: - (not measured" in text
    assert "rejects 10.0% of its sampled sequences (R-KV alone: 5.0%)" in text
    full = {"tokens": [[1, 2], [3, 4], [5, 6], [7, 8]], "logps": [[-1.0, -2.0]] * 4, "peak_running": 4}
    small = {"tokens": [[1, 2], [3, 9]], "logps": [[-1.0, -2.5], [-1.0, -2.0]], "peak_running": 2}
    line = bitwise_line("dense", full, small, 1, 2, (10, 20))
    assert "1/2 sequences with the same token ids" in line and "5.00e-01" in line
    assert "first differing: prompt 0 sample 1, at token 1" in line


def test_gpu_mode_runs_its_rollout_half_on_the_cpu_at_a_tiny_shape(tmp_path, capsys):
    from benchmarks import fixed_memory as fm

    fm.main(["--gpu", "--device", "cpu", "--shape", "tiny", "--prompts", "2", "--n", "2", "--max-new-tokens", "8",
             "--dense-seqs", "2", "--bitwise-prompts", "1", "--rows", "dense_optimistic", "rkv_tail",
             "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "--gpu: tiny random weights (bfloat16) on cpu" in out and "captured decode off (not CUDA)" in out
    rows = _rows(out.split("**--gpu tiny", 1)[1])
    assert set(rows) == {"dense, optimistic", "R-KV tail"}
    assert float(rows["dense, optimistic"][1]) > 0 and rows["dense, optimistic"][3] != "- / -"
    assert 0 < float(rows["dense, optimistic"][10]) <= 1.5  # the mismatch tail, measured in place of training
    assert out.count("2/2 sequences with the same token ids") == 4  # as measured, and again under the table
