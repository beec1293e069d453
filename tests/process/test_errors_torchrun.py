"""A user error under the real torchrun with 2 processes is one `error:` line (local rank 0 prints it, the other rank
stays silent), no traceback from sparserl, a non-zero exit, and torchrun's closing summary names the error (the
elastic error file) instead of "To enable traceback see ...". About 5 s: torchrun and two ranks that stop at the
command line, before torch is imported."""
import os
import re
import subprocess
import sys

from tests.launch import ROOT


def test_a_bad_key_under_torchrun_is_one_error_line_named_in_the_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "sparserl.trainer.grpo", "trainer.total_stepz=3", f"trainer.output_dir={tmp_path}/run"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == ["error: unknown config key 'trainer.total_stepz'; did you mean trainer.total_steps, "
                      "trainer.prompts_per_step, trainer.eval_every? (valid under trainer: "
                      + errors[0].split("(valid under trainer: ", 1)[1]], out
    # torchrun's summary: the root cause is rank 0's exit 2 and names the error; the silent rank was stopped.
    root_cause = out.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 2" in root_cause and "traceback : error: unknown config key 'trainer.total_stepz'" in root_cause
    assert "To enable traceback" not in out
    # The only traceback is torchrun's own (its launcher re-raises the failure): no frame of sparserl's.
    assert not re.search(r'File ".*sparserl/', out) and out.count("Traceback (most recent call last)") <= 1
    assert not (tmp_path / "run").exists()
