"""Resuming keeps the run it continues: real trainer runs of a tiny model (tests/launch.py).

- A checkpoint records the settings it was trained with: a resume that changes a LoRA setting is refused with one
  line, and `auto` precision and the count of skipped steps in a row carry on (sparserl/trainer/resume.py).
- Under the default settings a run checkpoints every `trainer.save_every` steps: killed with SIGKILL, it resumes
  with trainer.resume=auto having lost at most that many steps.
"""
from __future__ import annotations

import pytest
import yaml

from sparserl.config import TrainerConfig
from sparserl.utils import precision
from tests.e2e.test_trainer import read_metrics, side_by_side, tiny_args, trainer, write_data

ROWS = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]

# Rewards the sum. With KILL_AFTER_STEP set, rank KILL_RANK kills itself with SIGKILL at its first env step after
# that step's metrics row was written, i.e. in the middle of the next step's rollout.
ENV = '''
import json
import os
import signal
from pathlib import Path

from sparserl.rewards.math import extract_last_integer


def _logged(path):
    if not path.exists():
        return set()
    text = path.read_text()
    return {json.loads(line)["step"] for line in text[: text.rfind("\\n") + 1].splitlines() if line.strip()}


async def step(state, action, extra_info):
    after = os.environ.get("KILL_AFTER_STEP")
    if after and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]:
        if int(after) in _logged(Path(os.environ["KILL_METRICS"])):
            os.kill(os.getpid(), signal.SIGKILL)
    ok = extract_last_integer(action) == int(extra_info["answer"])
    return {"next_state": None, "reward": float(ok), "done": True}
'''


@pytest.fixture
def task(tmp_path):
    env = tmp_path / "env.py"
    env.write_text(ENV)
    return write_data(tmp_path / "train.jsonl", ROWS), env


def last_line(stderr: str) -> str:
    return [line for line in stderr.strip().splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_lora_resume_refuses_changed_settings_and_restores_precision_and_skips(tiny_checkpoint, task, tmp_path):
    data, env = task
    out = tmp_path / "lora"
    # The precision the first run resolved to: the one `auto` would not pick on this machine now.
    saved_dtype = "bfloat16" if precision.choose_auto("cpu").dtype == "float32" else "float32"
    lora = {"actor.lora.rank": 4, "actor.lora.alpha": 16, "actor.lora.target_modules": "[q_proj,v_proj,up_proj]"}

    def args(**extra):
        return tiny_args(tiny_checkpoint, data, env, out, steps=4, **{**lora, **extra})

    # Steps 1-2, step 2's update skipped as non-finite (SPARSERL_FAULT): the checkpoint of step 2 was saved after
    # one skipped step in a row, by a run whose precision was `saved_dtype`.
    res = trainer(args(**{"trainer.stop_after": 2, "model.compute_dtype": saved_dtype, "rollout.dtype": saved_dtype}),
                  extra_env={"SPARSERL_FAULT": "nan_loss:2:0"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert [m["actor/skipped_steps"] for m in read_metrics(out)] == [0, 1]

    # What cannot change: one line naming the key, the saved and the given value; nothing trained or logged.
    ckpt = out / "checkpoints" / "step_000002"
    alpha, targets = side_by_side(
        lambda: trainer(args(**{"trainer.resume": "auto", "actor.lora.alpha": 8})),
        lambda: trainer(args(**{"trainer.resume": "auto", "actor.lora.target_modules": "[q_proj,v_proj]"})))
    print("changed alpha:", alpha.returncode, last_line(alpha.stderr))
    print("changed target_modules:", targets.returncode, last_line(targets.stderr))
    assert alpha.returncode == 2 and "Traceback" not in alpha.stderr
    assert last_line(alpha.stderr) == (
        f"error: trainer.resume={ckpt}: actor.lora.alpha=8.0, but the checkpoint was saved with actor.lora.alpha=16.0; "
        "it cannot change on resume (it scales the saved adapters' update B @ A): resume with actor.lora.alpha=16.0, "
        "or start a new run")
    assert targets.returncode == 2
    assert ("actor.lora.target_modules=[q_proj,v_proj], but the checkpoint was saved with "
            "actor.lora.target_modules=[q_proj,v_proj,up_proj]") in last_line(targets.stderr)
    assert [m["step"] for m in read_metrics(out)] == [1, 2]

    # What carries on: the precision (auto given again) and the skipped-steps count. Step 3 is skipped as well: with
    # trainer.max_skipped_steps=2 that is two in a row, so the run stops there.
    res = trainer(args(**{"trainer.resume": "auto", "trainer.max_skipped_steps": 2, "model.compute_dtype": "auto",
                          "rollout.dtype": "auto"}), extra_env={"SPARSERL_FAULT": "nan_loss:3:0"})
    print("resumed:", res.returncode, last_line(res.stderr))
    written = yaml.safe_load((out / "config.yaml").read_text())
    print("resumed precision:", written["model"]["compute_dtype"], written["rollout"]["dtype"])
    assert (written["model"]["compute_dtype"], written["rollout"]["dtype"]) == (saved_dtype, saved_dtype)
    assert f"as the resumed run resolved it ({ckpt})" in res.stdout
    assert res.returncode == 3, res.stderr[-3000:]
    assert last_line(res.stderr).startswith(
        "stopped: step 3: 2 optimizer steps in a row had a non-finite loss or gradient norm and were skipped")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


@pytest.mark.slow
def test_default_settings_checkpoint_at_an_interval_and_sigkill_resume_loses_at_most_it(tiny_checkpoint, task,
                                                                                        tmp_path):
    data, env = task
    out = tmp_path / "killed"
    every = TrainerConfig().save_every
    print("default trainer.save_every:", every, "trainer.keep_last:", TrainerConfig().keep_last)
    assert every > 0, "the default trainer.save_every must checkpoint during the run"
    steps = every + 3
    args = tiny_args(tiny_checkpoint, data, env, out, steps=steps)  # no trainer.save_every / keep_last given
    assert not any(a.startswith(("trainer.save_every=", "trainer.keep_last=")) for a in args)
    killed = trainer(args, nproc=2, extra_env={"KILL_AFTER_STEP": str(every + 2), "KILL_RANK": "1",
                                               "KILL_METRICS": str(out / "metrics.jsonl")})
    assert killed.returncode != 0  # rank 1 died by SIGKILL in the middle of step every + 3
    logged = [m["step"] for m in read_metrics(out)]
    assert logged == list(range(1, every + 3)), logged
    ckpts = out / "checkpoints"
    found = sorted(p.name for p in ckpts.iterdir() if (p / "COMPLETE").exists()) if ckpts.is_dir() else []
    print(f"killed in step {every + 3}: complete checkpoints {found}")

    res = trainer(args + ["trainer.resume=auto"], nproc=2)
    said = [line for line in (res.stdout + res.stderr).splitlines() if "resumed from" in line]
    print("resume:", res.returncode, said or "no checkpoint to resume from: started over at step 1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert found == [f"step_{every:06d}"]
    assert said and said[0].endswith(f"step_{every:06d} at step {every}")  # lost steps every+1, every+2 only
    assert [m["step"] for m in read_metrics(out)] == list(range(1, steps + 1))  # each step once
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{every:06d}", f"step_{steps:06d}"]
