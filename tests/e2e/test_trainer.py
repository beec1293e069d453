"""Tiny full runs of `sparserl.trainer.grpo`: dense parity, env errors, export, resume, bad input."""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]

FAILING_ENV = '''
from sparserl.rewards.math import extract_last_integer
max_turns = 1

async def step(state, action, extra_info):
    if extra_info["answer"] == "2":
        raise RuntimeError("this env step fails on purpose")
    ok = extract_last_integer(action) == int(extra_info["answer"])
    return {"next_state": None, "reward": float(ok), "score": float(ok), "done": True, "extra_info": extra_info}
'''


def write_data(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trainer(args, nproc=1, cwd=None, timeout=600, extra_env=None, torchrun=False):
    """Run the GRPO trainer on nproc processes through tests/launch.py, or under torchrun itself with `torchrun`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0", **(extra_env or {})}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "sparserl.trainer.grpo", *args]
    else:
        cmd = command(nproc, "-m", "sparserl.trainer.grpo", *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)


def side_by_side(*calls):
    """Call `calls` (each runs its own trainer processes) two at a time; their results in order. The trainer's test
    processes run one thread each, so two runs share the 2 cores that one run's start-up (imports on one core) leaves
    half idle. A failure in either is raised here."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# What `trainer_state.pt` held before the registry of saved state, in order (kv_budget after sampler when set); the
# run id (trainer/run_dir.py) comes after them.
LEGACY_KEYS = ["step", "scheduler", "sampler", "world_size", "tp", "cp", "settings", "consecutive_skips"]


def saved_state(out: Path, step: int) -> dict:
    import torch

    return torch.load(out / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt", weights_only=True)


def tiny_args(ckpt, data, env_path, out, steps=2, **extra):
    args = {"model.path": ckpt, "model.compute_dtype": "float32", "rollout.dtype": "float32",
            "data.train_path": data, "env.path": env_path, "trainer.output_dir": out, "trainer.total_steps": steps,
            "trainer.prompts_per_step": 4, "rollout.n": 2, "rollout.max_new_tokens": 8, "actor.lr": 1e-3,
            "actor.max_tokens_per_device": 256, "algo.entropy_coef": 0.01}  # entropy: a gradient even when all rewards tie
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture
def task(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = write_data(tmp_path / "train.jsonl", rows)
    env = tmp_path / "env.py"
    env.write_text(FAILING_ENV)
    return data, env


def test_dense_run_parity_env_errors_and_export(tiny_checkpoint, task, tmp_path):
    data, env = task
    out = tmp_path / "run"
    # The correction is on: with dense rollouts it must change nothing beyond numerical noise.
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, **{"+preset": "dense", "algo.correction.enable": "true"}))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/abs_max"] < 1e-4
        # The prompt whose env step raises: its 2 samples get reward 0 and status error; training goes on.
        assert m["env/error_count"] == 2 and m["env/error_frac"] == pytest.approx(2 / 8)
        assert m["actor/grad_norm"] > 0
        assert 1 - 1e-4 < m["correction/weight_min"] <= m["correction/weight_max"] < 1 + 1e-4
        assert m["correction/rejected_seq_frac"] == 0 and m["correction/kept_token_frac"] == 1.0
    assert (out / "config.yaml").exists()
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    diffs = [(a - b).abs().max().item() for a, b in zip(trained.state_dict().values(), initial.state_dict().values())]
    assert max(diffs) > 0, "the exported policy is the initial one"
    assert "step 2/2" in res.stdout
    assert "done: 2 of 2 steps" in res.stdout and f"report:   python -m sparserl.report {out}" in res.stdout
    for noise in ("Loading weights", "Writing model shards", "FutureWarning"):  # library noise stays off the console
        assert noise not in res.stdout + res.stderr, noise
    pool = re.search(r"rollout engine native: KV pool [\d.]+ [KMG]B \([^)]*\) = (\d+) entries x (\d+) B",
                     res.stdout + res.stderr)
    assert pool and int(pool[1]) > 0 and int(pool[2]) > 0, "the run's log must say the KV pool the engine got"


# The run with a critic (+preset=ppo: GAE, the KL in the reward, the critic's shards and schedule in the checkpoint)
# is `slow`; tests/unit/test_critic.py resumes a critic bitwise in one process.
@pytest.mark.parametrize("extra", [pytest.param({}, id="grpo"),
                                   pytest.param({"+preset": "ppo", "critic.lr": 1e-3}, id="ppo", marks=pytest.mark.slow)])
def test_resume_matches_uninterrupted_run(tiny_checkpoint, task, tmp_path, extra):
    data, env = task
    full, cut = tmp_path / "full", tmp_path / "cut"

    def cut_then_resume():
        res = trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=3, **{"trainer.stop_after": 2}, **extra), nproc=2)
        assert res.returncode == 0, res.stderr[-3000:]
        assert [m["step"] for m in read_metrics(cut)] == [1, 2] and not (cut / "hf").exists()
        return trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=3, **{"trainer.resume": "auto"}, **extra), nproc=2)

    for res in side_by_side(lambda: trainer(tiny_args(tiny_checkpoint, data, env, full, steps=3, **extra), nproc=2),
                            cut_then_resume):
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_metrics(full), read_metrics(cut)
    assert [m["step"] for m in b] == [1, 2, 3]
    # The trainer state holds the keys, in the order, checkpoints have always had (trainer/saved_state.py).
    critic = ["critic_scheduler"] if extra else []
    assert list(saved_state(cut, 2)) == LEGACY_KEYS + ["run_id"] + critic and saved_state(cut, 2)["step"] == 2
    assert all("critic/value_loss" in m for m in b) == bool(extra)
    timing = ("perf/", "mem/", "kv/compress_s")
    for key, value in a[2].items():
        if not key.startswith(timing):
            assert b[2][key] == value, key  # bitwise: same seeds, same state, same order of operations


@pytest.mark.parametrize(
    "override, expect",
    [
        ("actor.lrr=1", "did you mean actor.lr"),
        ("model.path=/nonexistent/ckpt", "model.path=/nonexistent/ckpt"),
        ("env.path=/nonexistent/env.py", "env.path=/nonexistent/env.py"),
        ("data.train_path=BAD", "row 1: no 'prompt' or 'messages' field"),
    ],
)
def test_bad_input_one_line_nonzero_exit_nothing_written(tiny_checkpoint, task, tmp_path, override, expect):
    data, env = task
    bad = write_data(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, {"question": "no prompt", "answer": "2"}])
    out = tmp_path / "never"
    args = tiny_args(tiny_checkpoint, data, env, out) + [override.replace("BAD", str(bad))]
    res = trainer(args)
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and expect in lines[-1], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_auto_kv_budget_follows_the_tail_and_resumes(tiny_checkpoint, task, tmp_path):
    """rollout.kv.budget=auto: each step's kv/budget is what the controller's rule gives from the previous steps'
    logged sampler/xi_p05, and a resumed run continues with the saved controller state (bitwise the same step 3)."""
    from sparserl.kv.budget_control import BudgetControlConfig, BudgetController

    data, env = task
    control = {"floor": 8, "ceiling": 32, "target": 0.5, "hysteresis": 0.0, "factor": 2.0, "patience": 1, "align": 4}
    kv = {"rollout.kv.algorithm": "rkv", "rollout.kv.budget": "auto", "rollout.kv.window": 2,
          "rollout.kv.divide_length": 4, "rollout.kv.compress_prompt": "true", "rollout.max_new_tokens": 24,
          **{f"rollout.kv.control.{k}": v for k, v in control.items()}}
    full, cut = tmp_path / "full", tmp_path / "cut"
    res = trainer(tiny_args(tiny_checkpoint, data, env, full, steps=3, **kv))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(full)
    ctrl = BudgetController(BudgetControlConfig(**control))
    for m in metrics:
        assert m["kv/budget"] == ctrl.budget and m["kv/compressions"] > 0
        ctrl.update(m["sampler/xi_p05"])
    assert len({m["kv/budget"] for m in metrics}) > 1, "the budget never moved: pick a target the tiny model crosses"
    # `python -m sparserl.eval` of the finished run samples at the controller's budget after the last step (saved with
    # its checkpoint), not at the ceiling.
    from sparserl.config.load import load_config
    from sparserl.eval.run_settings import take_run_settings

    argv = [f"model.path={full / 'hf'}"]
    evaluated, _ = take_run_settings(load_config(argv, "eval"), argv)
    assert evaluated.rollout.kv.budget == saved_state(full, 3)["kv_budget"]["budget"] == ctrl.budget
    res = trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=3, **kv, **{"trainer.stop_after": 2}))
    assert res.returncode == 0, res.stderr[-3000:]
    res = trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=3, **kv, **{"trainer.resume": "auto"}))
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = read_metrics(cut)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    keys = LEGACY_KEYS[:3] + ["kv_budget"] + LEGACY_KEYS[3:] + ["run_id"]
    assert list(saved_state(cut, 2)) == keys and saved_state(cut, 2)["kv_budget"]["budget"] == metrics[2]["kv/budget"]
    for key, value in metrics[2].items():
        if not key.startswith(("perf/", "mem/", "kv/compress_s")):
            assert resumed[2][key] == value, key
