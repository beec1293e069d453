"""Faults on real 2-process (and 1- and 4-process) torchrun runs of a tiny model: preemption, a killed rank,
elastic resume, non-finite steps, hung envs. Each ends with nothing lost: resuming gives the run that was
never interrupted (bitwise where the world size is unchanged)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparserl.eval.model import load_dcp_weights
from tests.e2e.test_trainer import ROOT, read_metrics, side_by_side, tiny_args, trainer, write_data

# Rewards the sum; each step call sleeps so a step lasts long enough to be interrupted in the middle.
SLOW_ENV = '''
import asyncio
from sparserl.rewards.math import extract_last_integer

async def step(state, action, extra_info):
    await asyncio.sleep(1.0)
    ok = extract_last_integer(action) == int(extra_info["answer"])
    return {"next_state": None, "reward": float(ok), "done": True}
'''

HANGING_ENV = '''
import asyncio

async def step(state, action, extra_info):
    if extra_info["answer"] == "5":
        await asyncio.sleep(3600)
    return {"next_state": None, "reward": 1.0, "done": True}
'''

TIMING = ("perf/", "mem/", "kv/compress_s")


@pytest.fixture(scope="module")
def slow_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow_task")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    env = root / "slow_env.py"
    env.write_text(SLOW_ENV)
    return write_data(root / "train.jsonl", rows), env


def start(args, nproc) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "sparserl.trainer.grpo", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def workers(proc: subprocess.Popen) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes (its children)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != proc.pid:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
            found[int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return found


def logged_steps(path: Path) -> set[int]:
    """Steps of the complete lines of a metrics.jsonl that may be being written (a last line without its newline
    is still being written and is not read)."""
    if not path.exists():
        return set()
    text = path.read_text()
    return {json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()}


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if step in logged_steps(out / "metrics.jsonl"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "hf" / "model.safetensors")


def assert_same_run(a: Path, b: Path) -> None:
    """Same metrics for every step (each step once) and bitwise-equal final weights."""
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in mb] == [m["step"] for m in ma]
    for ra, rb in zip(ma, mb):
        for key, value in ra.items():
            if not key.startswith(TIMING):
                assert rb[key] == value, (ra["step"], key)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tiny_checkpoint, slow_task, tmp_path_factory):
    """The reference: the same 5-step run, never interrupted (shared by the preemption and kill tests)."""
    data, env = slow_task
    out = tmp_path_factory.mktemp("uninterrupted") / "full"
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=5), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow
def test_sigterm_mid_step_saves_that_step_and_resume_matches(tiny_checkpoint, slow_task, tmp_path, uninterrupted):
    data, env = slow_task
    out = tmp_path / "preempted"
    proc = start(tiny_args(tiny_checkpoint, data, env, out, steps=5), nproc=2)
    wait_for_step(out, 2, proc)
    time.sleep(0.3)  # step 3 has begun: its env calls take a second
    pids = workers(proc)
    assert sorted(pids) == [0, 1]
    for pid in pids.values():  # as a cluster scheduler does: every worker gets the signal
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "stopped: preempted (SIGTERM) during step 3" in err and "continue with trainer.resume=auto" in err
    assert "exitcode  : 75" in err  # torchrun's failure summary shows the workers' own exit code
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_000003"]
    assert (out / "checkpoints" / "step_000003" / "COMPLETE").exists()
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]

    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=5, **{"trainer.resume": "auto"}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout + res.stderr
    assert_same_run(uninterrupted, out)


@pytest.mark.slow
def test_kill_9_of_one_rank_then_resume_loses_nothing(tiny_checkpoint, slow_task, tmp_path, uninterrupted):
    data, env = slow_task
    out = tmp_path / "killed"
    args = tiny_args(tiny_checkpoint, data, env, out, steps=5, **{"trainer.save_every": 2})
    proc = start(args, nproc=2)
    wait_for_step(out, 3, proc)
    time.sleep(0.3)  # inside step 4
    os.kill(workers(proc)[1], signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    ckpts = out / "checkpoints"
    assert checkpoint_names(ckpts) == ["step_000002"]
    # What a kill in the middle of a save leaves behind: never resumed from, swept by the next save.
    (ckpts / ".step_000004.tmp").mkdir()
    (ckpts / "step_000004").mkdir()
    (ckpts / "step_000004" / ".metadata").write_text("half-written")

    res = trainer(args + ["trainer.resume=auto"], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout + res.stderr and "step_000002 at step 2" in res.stdout + res.stderr
    assert checkpoint_names(ckpts) == ["step_000002", "step_000004", "step_000005"]
    assert not any(p.name.startswith(".") for p in ckpts.iterdir())
    assert_same_run(uninterrupted, out)  # metrics: steps 1..5 once each (step 3's first row was dropped)


def checkpoint_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "COMPLETE").exists())


def _resume_with(base: Path, tmp_path: Path, nproc: int, args) -> Path:
    out = tmp_path / f"{base.name}_to_{nproc}"
    shutil.copytree(base, out)
    res = trainer(args(out) + ["trainer.resume=auto"], nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    saved_with = int(base.name.rsplit("_", 1)[1])
    said = f"(saved with {saved_with} processes, now {nproc})"
    assert (said in res.stdout + res.stderr) == (saved_with != nproc)
    return out


def _assert_close(ref: Path, got: Path, rel: float = 1e-6) -> None:
    a, b = read_metrics(ref)[-1], read_metrics(got)[-1]
    assert a["step"] == b["step"] == 3
    for key in ("actor/loss", "actor/pg_loss", "reward/mean"):
        assert abs(a[key] - b[key]) <= rel * max(abs(a[key]), 1e-12), (key, a[key], b[key])
    # The gradient is a sum with heavy cancellation (norm ~1e-5 here), summed in another order on another mesh.
    assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) <= 1e-4 * a["actor/grad_norm"]
    wa, wb = final_weights(ref), final_weights(got)
    assert set(wa) ^ set(wb) <= {"lm_head.weight"}  # tied to the embeddings: written or not depending on storage sharing
    for k in set(wa) & set(wb):
        scale = wa[k].abs().max().item()
        assert (wa[k] - wb[k]).abs().max().item() <= rel * max(scale, 1e-12), k


@pytest.mark.slow
def test_elastic_resume_on_another_number_of_processes(tiny_checkpoint, task_args, tmp_path):
    """Saved with N processes, resumed with M: step 3's loss and the weights after it equal (1e-6 rel) a resume
    on the same number of processes, i.e. a run that never changed world size. 2 -> 1, 2 -> 4, 1 -> 2."""
    bases = {n: tmp_path / f"saved_{n}" for n in (2, 1)}
    for res in side_by_side(*[lambda n=n: trainer(task_args(bases[n]) + ["trainer.stop_after=2"], nproc=n) for n in bases]):
        assert res.returncode == 0, res.stderr[-3000:]
    resumes = [(2, 2), (2, 1), (2, 4), (1, 1), (1, 2)]  # (saved with, resumed with)
    ref, to_1, to_4, ref_1, to_2 = side_by_side(*[lambda s=s, n=n: _resume_with(bases[s], tmp_path, n, task_args)
                                                  for s, n in resumes])
    _assert_close(ref, to_1)
    _assert_close(ref, to_4)
    _assert_close(ref_1, to_2)


@pytest.fixture
def task_args(tiny_checkpoint, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = write_data(tmp_path / "train.jsonl", rows)
    env = tmp_path / "env.py"
    env.write_text(SLOW_ENV.replace("await asyncio.sleep(1.0)", "pass"))
    return lambda out: tiny_args(tiny_checkpoint, data, env, out, steps=3)


def test_nan_loss_on_one_rank_skips_the_step_everywhere(tiny_checkpoint, task_args, tmp_path):
    out, stop = tmp_path / "nan", tmp_path / "nan_stop"
    res, stopped = side_by_side(
        lambda: trainer(task_args(out) + ["trainer.save_every=1"], nproc=2, extra_env={"SPARSERL_FAULT": "nan_loss:2:1"}),
        lambda: trainer(task_args(stop) + ["trainer.save_every=1", "trainer.total_steps=4", "trainer.max_skipped_steps=2"],
                        nproc=2, extra_env={"SPARSERL_FAULT": "nan_loss:2,3:0"}))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["actor/skipped_steps"] for m in metrics] == [0, 1, 0]
    weights = {s: dict(load_dcp_weights(out / "checkpoints" / f"step_{s:06d}")) for s in (1, 2, 3)}
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])  # step 2 changed no weight
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # step 3 trained again

    assert stopped.returncode != 0
    line = next(x for x in stopped.stderr.splitlines() if x.startswith("stopped:"))
    assert "step 3: 2 optimizer steps in a row had a non-finite loss or gradient norm" in line
    assert f"the last good checkpoint is {stop / 'checkpoints' / 'step_000002'}" in line
    assert "Traceback" not in stopped.stderr.split("stopped:")[0][-2000:]


def test_hung_env_step_times_out_and_the_run_finishes(tiny_checkpoint, tmp_path):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = write_data(tmp_path / "train.jsonl", rows)
    env = tmp_path / "hanging_env.py"
    env.write_text(HANGING_ENV)
    out = tmp_path / "hung"
    t0 = time.time()
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=1, **{"env.step_timeout_s": 2}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert time.time() - t0 < 300
    (m,) = read_metrics(out)
    assert m["env/timeout_frac"] == pytest.approx(0.25)  # one prompt of four, both its samples
