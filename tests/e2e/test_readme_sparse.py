"""README.md's sparse command compresses on the default task: its overrides (everything after the module name, on the
README's `+preset=sparse_rl` torchrun line) on a tiny model with one step log `kv/compressions` > 0 and
`kv/retained_frac` < 1, and the start-up lines say what the console's `kv` figure means. The real model's run of the
command as written is in docs/kv_compression.md; this keeps the README's command one that compresses."""
import re
import shlex
from pathlib import Path

from tests.e2e.test_trainer import read_metrics, trainer

ROOT = Path(__file__).resolve().parents[2]


def readme_sparse_overrides() -> list[str]:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("torchrun --nproc_per_node=2 -m sparserl.trainer.grpo") and "+preset=sparse_rl" in line]
    assert len(lines) == 1, f"README.md should have one sparse torchrun command, found {lines}"
    words = shlex.split(lines[0].split("-m sparserl.trainer.grpo", 1)[1])
    assert all("=" in w for w in words), words
    return words


def test_the_readme_sparse_command_compresses_on_the_default_task(tiny_checkpoint, tmp_path):
    overrides = [w for w in readme_sparse_overrides() if not w.startswith("trainer.total_steps=")]
    out = tmp_path / "sparse"
    res = trainer([*overrides, f"model.path={tiny_checkpoint}", f"trainer.output_dir={out}", "trainer.total_steps=1",
                   "trainer.prompts_per_step=4", "rollout.n=2", "trainer.export_hf=false"], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = read_metrics(out)[-1:]
    assert row["kv/compressions"] > 0 and row["kv/retained_frac"] < 1, row
    said = res.stdout + res.stderr
    assert re.search(r"the console's kv figure", said), said[-2000:]
