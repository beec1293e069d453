"""Seconds per training step and their split (rollout / old log-probs / update / weight sync).

    python benchmarks/train_step.py --nproc 2 --steps 3 [key=value overrides ...]

Runs `sparserl.trainer.grpo` under torchrun for `--steps` steps in a temporary folder (default preset unless
overridden) and prints the mean of each timing over the steps after the first (the first includes warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402

KEYS = ["perf/step_s", "perf/rollout_s", "perf/old_logprobs_s", "perf/update_s", "perf/weight_sync_s",
        "perf/rollout_tok_s", "perf/train_tok_s", "response/len_mean", "mem/peak_gb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "sparserl.trainer.grpo", f"trainer.total_steps={args.steps}", f"trainer.output_dir={tmp}/run",
               "trainer.export_hf=false", *args.overrides]
        env = {**os.environ, "SPARSERL_PROGRESS": "0"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"training failed:\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    timed = rows[1:] or rows
    print(f"machine: {machine()}\nprocesses: {args.nproc}; overrides: {' '.join(args.overrides) or '(default preset)'}\n")
    print_table(["metric", "mean over steps 2.." + str(len(rows))],
                [[k, f"{sum(r.get(k, 0.0) for r in timed) / len(timed):.3f}"] for k in KEYS])


if __name__ == "__main__":
    main()
