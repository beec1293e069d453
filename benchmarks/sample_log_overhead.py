"""What logging samples (`trainer.log_samples`) costs on a training step: its phase time over the step time.

    python benchmarks/sample_log_overhead.py --out outputs/bench_sample_log [--nproc 2 --steps 3] [key=value ...]

Runs the default training command (`torchrun --nproc_per_node=NPROC -m sparserl.trainer.grpo`: SmolLM2-135M-Instruct,
16 prompts x 8 samples, 48 new tokens, the default `trainer.log_samples=4`) for `--steps` steps, plus any overrides
given, and reads `perf/log_samples_s` (rank 0's time to pick the sequences, fetch their logp_old from whichever rank
trained them, recompute the correction's flags, decode the tokens, write `samples/step_N.jsonl`) and `perf/step_s`
from metrics.jsonl. Prints both per step and the share of the step; the target is under 2%.

The phase is timed inside the step rather than by an A/B pair of runs: step times of a CPU run vary by more than
2% from step to step, so the difference of two runs could not resolve the number.

Left out on purpose: the wandb Table (wandb is not installed by default; `logger.wandb.mode=offline` adds it, and
its cost then shows in the same number).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench_sample_log", help="trainer.output_dir of the run")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for the trainer")
    args = ap.parse_args()
    out = Path(args.out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "sparserl.trainer.grpo", f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}",
           "trainer.export_hf=false", "trainer.overwrite=true", *args.overrides]  # a rerun starts over
    print(" ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSERL_PROGRESS": "0"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    if not rows or "perf/log_samples_s" not in rows[0]:
        sys.exit("no perf/log_samples_s in metrics.jsonl: was trainer.log_samples set to 0?")
    print(f"{'step':>4}  {'log_samples_s':>13}  {'step_s':>8}  {'share':>8}")
    for r in rows:
        print(f"{r['step']:>4}  {r['perf/log_samples_s']:>13.4f}  {r['perf/step_s']:>8.2f}  {r['perf/log_samples_s'] / r['perf/step_s']:>8.3%}")
    total = sum(r["perf/log_samples_s"] for r in rows) / sum(r["perf/step_s"] for r in rows)
    sizes = [p.stat().st_size for p in (out / "samples").glob("step_*.jsonl")]
    print(f"sample logging: {total:.3%} of the step time over {len(rows)} steps (target < 2%); "
          f"step files {min(sizes) / 1024:.1f}-{max(sizes) / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
