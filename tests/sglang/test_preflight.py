"""`rollout.engine=sglang` user errors: one line naming the fix, exit code 2, nothing written."""
import subprocess
import sys

import pytest

from tests.sglang.host import HAVE_SGLANG, ROOT


def run_trainer(tmp_path, *overrides):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sparserl.trainer.grpo", "rollout.engine=sglang", f"trainer.output_dir={out}",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.skipif(HAVE_SGLANG, reason="sglang is installed here")
def test_missing_sglang_names_the_install_command(tmp_path):
    proc, out = run_trainer(tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rollout.engine=sglang needs SGLang")
    assert 'pip install -e ".[sglang]"' in lines[0] and "scripts/install_sglang_cpu.sh" in lines[0]
    assert not out.exists()
