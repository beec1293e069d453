"""Runs do not collide: with the default `trainer.output_dir=auto` each run gets its own folder under outputs/grpo/
(rank 0 names it, both ranks write to it), `latest` points to the newest, `python -m sparserl.report outputs/grpo`
reads that one; a named folder that holds a run is refused unless resuming; a checkpoint of another run is refused
on resume (its run id). tests/unit/test_run_folders.py checks the same choices in-process (and `trainer.resume=auto`
with the default folder), in a second."""
import shutil
import subprocess
import time

import pytest
import yaml

from sparserl.utils import runs
from tests.e2e.test_trainer import ROOT, read_metrics, tiny_args, trainer, write_data
from tests.launch import command


def _args(ckpt, data, env, steps, **extra):
    """tiny_args without trainer.output_dir (the default folder) unless `extra` names one."""
    args = tiny_args(ckpt, data, env, "unused", steps=steps, **extra)
    return args if "trainer.output_dir" in extra else [a for a in args if not a.startswith("trainer.output_dir=")]


def _error_lines(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # four trainer processes (~50 s); the unit test of the same choices takes seconds
def test_two_runs_in_the_default_folder_do_not_mix(tiny_checkpoint, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data, env = write_data(tmp_path / "train.jsonl", rows), ROOT / "envs" / "arithmetic.py"
    work = tmp_path / "work"
    work.mkdir()
    root = work / "outputs" / "grpo"

    first = trainer(_args(tiny_checkpoint, data, env, 1, **{"trainer.export_hf": "false", "trainer.log_samples": 0}),
                    nproc=2, cwd=work)
    assert first.returncode == 0, first.stderr[-3000:]
    a = runs.latest_run(root)
    time.sleep(1.1)  # a new second: the second folder gets its own time stamp (a same-second start gets a -2 suffix)
    second = trainer(_args(tiny_checkpoint, data, env, 2, **{"trainer.save_every": 1, "trainer.log_samples": 0}), cwd=work)
    assert second.returncode == 0, second.stderr[-3000:]
    b = runs.latest_run(root)

    assert a is not None and b is not None and a != b and a.parent == b.parent == root
    assert sorted(p.name for p in root.iterdir()) == sorted([a.name, b.name, "latest"])
    assert [m["step"] for m in read_metrics(a)] == [1] and [m["step"] for m in read_metrics(b)] == [1, 2]
    assert [p.name for p in (a / "checkpoints").iterdir()] == ["step_000001"] and not (a / "hf").exists()
    # Both ranks of run A wrote their checkpoint shards into the one folder rank 0 named.
    assert sorted(p.name for p in (a / "checkpoints" / "step_000001").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_000001", "step_000002"] and (b / "hf").is_dir()
    ids = runs.read_run_id(a), runs.read_run_id(b)
    assert all(ids) and ids[0] != ids[1]
    rel = f"outputs/grpo/{b.name}"  # as the run names its folder: under the current one
    assert yaml.safe_load((b / "config.yaml").read_text())["trainer"]["output_dir"] == rel

    # The report of the folder of runs is the newest run's.
    report = subprocess.run(command(1, "-m", "sparserl.report", "outputs/grpo"), capture_output=True, text=True,
                            timeout=300, cwd=work)
    assert report.returncode == 0, report.stderr
    assert (work / report.stdout.strip()).resolve() == (b / "report.html").resolve()

    # A named folder that holds a run: one line, before any work, and nothing of it changed.
    before = (a / "metrics.jsonl").read_text()
    refused = trainer(_args(tiny_checkpoint, data, env, 1, **{"trainer.output_dir": a}), cwd=work)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    (line,) = _error_lines(refused)
    assert f"trainer.output_dir={a} holds a run already (metrics up to step 1, a checkpoint of step 1)" in line
    assert "trainer.resume=auto" in line and "trainer.overwrite=true" in line
    assert (a / "metrics.jsonl").read_text() == before

    # A checkpoint of run A put among run B's: resuming B refuses it, naming both runs.
    shutil.copytree(a / "checkpoints" / "step_000001", b / "checkpoints" / "step_000003")
    (b / "checkpoints" / "step_000003" / "COMPLETE").write_text("3")
    mixed = trainer(_args(tiny_checkpoint, data, env, 4, **{"trainer.resume": "auto"}), cwd=work)
    assert mixed.returncode == 2 and "Traceback" not in mixed.stderr, mixed.stderr[-3000:]
    (line,) = _error_lines(mixed)
    assert f"the checkpoint is of run {ids[0]}, but trainer.output_dir={rel} holds run {ids[1]}" in line
