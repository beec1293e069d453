"""`python -m sparserl.eval` on shared eval sets with a tiny model, its bad inputs, and evaluation during training
(`trainer.eval_every`), checked against the standalone command on the run's checkpoint."""
import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}


def run_module(module, args, timeout=300):
    cmd = command(1, "-m", module, *[f"{k}={v}" for k, v in args.items()])
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def eval_args(model, out, **extra):
    args = {"model.path": model, "eval.output_dir": out, "eval.n": 2, "eval.k": "[1,2]", "eval.temperature": 1.0,
            "eval.max_new_tokens": 8, "rollout.dtype": "float32"}
    return {**args, **extra}


def test_eval_two_shared_sets(tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    res = run_module("sparserl.eval", eval_args(tiny_checkpoint, out, **{"eval.datasets": "[gsm8k,mawps]", "eval.limit": 8}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| gsm8k" in res.stdout and "| mawps" in res.stdout and "avg@2" in res.stdout
    summary = json.loads((out / "eval.json").read_text())
    assert summary["world_size"] == 1 and summary["eval"]["n"] == 2
    assert list(summary["datasets"]) == ["gsm8k", "mawps"]
    for m in summary["datasets"].values():
        assert m["prompts"] == 8
        for key in ("avg@2", "pass@1", "pass@2", "maj@2", "response_len", "truncated_frac", "kv_retained_frac", "kv_peak_tokens"):
            assert key in m, key
        assert 0 <= m["avg@2"] <= m["pass@2"] <= 1 and m["pass@1"] == pytest.approx(m["avg@2"])
        assert 0 < m["response_len"] <= 8 and m["kv_retained_frac"] == 1.0  # dense
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 8 * 2
    first = samples[0]
    assert (first["dataset"], first["index"], first["sample"]) == ("gsm8k", 0, 0)
    assert "Janet" in first["prompt"] and "\\boxed{}" in first["prompt"] and first["answer"] == "18"
    assert {s["index"] for s in samples if s["dataset"] == "mawps"} == set(range(8))
    for s in samples:
        assert set(s) >= {"prompt", "response", "extracted", "correct", "tokens", "finish_reason"}
        assert 0 < s["tokens"] <= 8 and isinstance(s["correct"], bool)


@pytest.mark.parametrize("override, expect", [
    ({"eval.datasets": "[{name:mine,path:/nonexistent/set.jsonl}]"}, "/nonexistent/set.jsonl"),
    ({"eval.datasets": "[{name:gsm8k,prompt_key:problem}]"}, "'problem'"),
    ({"eval.datasets": "[mawps]", "eval.k": "[1,4]"}, "eval.k=[1"),
])
def test_bad_input_one_line_exit_2_nothing_written(tiny_checkpoint, tmp_path, override, expect):
    out = tmp_path / "never"
    res = run_module("sparserl.eval", eval_args(tiny_checkpoint, out, **override))
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in res.stderr
    assert not out.exists()


def test_training_logs_eval_rows_and_matches_the_standalone_eval(tiny_checkpoint, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}) + "\n"
                            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]))
    run = tmp_path / "run"
    # A low eval temperature, so that the samples follow the weights the updates change.
    evals = {"eval.datasets": "[mawps]", "eval.limit": 4, "eval.n": 2, "eval.k": "[1,2]", "eval.temperature": 0.1,
             "eval.max_new_tokens": 6, "rollout.dtype": "float32"}
    res = run_module("sparserl.trainer.grpo", {
        "model.path": tiny_checkpoint, "model.compute_dtype": "float32", "data.train_path": data,
        "env.path": "envs/arithmetic.py", "trainer.output_dir": run, "trainer.total_steps": 10, "trainer.prompts_per_step": 2,
        "rollout.n": 2, "rollout.max_new_tokens": 4, "actor.lr": 1e-2, "algo.entropy_coef": 0.1,  # entropy: updates move the weights
        "actor.max_tokens_per_device": 256, "trainer.export_hf": "false", "trainer.eval_every": 5, **evals})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(11))
    with_eval = [r["step"] for r in rows if any(k.startswith("eval/") for k in r)]
    assert with_eval == [0, 5, 10]
    for r in rows:
        if r["step"] in with_eval:
            assert r["eval/mawps/prompts"] == 4 and "eval/mawps/avg@2" in r and "eval/mawps/pass@2" in r
            assert "eval/mawps/maj@2" in r and r["eval/mawps/kv_retained_frac"] == 1.0 and r["eval/time_s"] > 0
    assert "reward/mean" not in rows[0] and "reward/mean" in rows[5]
    step = {s: read_jsonl(run / "eval" / f"step_{s:06d}" / "samples.jsonl") for s in (0, 5, 10)}
    assert [x["response"] for x in step[0]] != [x["response"] for x in step[10]]  # the engine evaluated fresh weights

    # The standalone command on the run (its latest DCP checkpoint: no hf/ was exported) draws the same samples.
    out = tmp_path / "standalone"
    res = run_module("sparserl.eval", {"model.path": run, "eval.output_dir": out, **evals})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "checkpoints/step_000010" in res.stdout
    assert read_jsonl(out / "samples.jsonl") == step[10]
