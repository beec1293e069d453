"""The features that meet, in one run of the default model: dynamic sampling, `+preset=sparse_rl` (R-KV rollouts and
the correction, with a veto at xi < 0.3 so that some sequences are rejected), `rollout.kv.budget=auto`, the dense
rescue, `algo.overlong.mask=true` and a LoRA actor, on 2 processes for 3 steps with budgets that make the engine
compress. Then the same run stopped after step 2 and resumed, which must log the same step 3 and end with the same
weights, bitwise.

    python scripts/features_together.py [OUT] [key=value ...]   # OUT default: outputs/features_together

Prints, per step, what the KV budget controller read (`kv/budget_tail`, the sampler's tail before any filter:
`sampler/xi_p05`) beside the trained batch's tail (`mismatch/xi_p05`), and the result of the resume check. Exits
non-zero when a run fails or the resumed run differs. About 10-20 minutes on a 2-core CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("perf/", "mem/", "kv/compress_s")
ARGS = {
    "+preset": "sparse_rl", "trainer.total_steps": 3, "trainer.prompts_per_step": 8, "rollout.n": 4,
    "rollout.max_new_tokens": 64, "rollout.kv.budget": "auto", "rollout.kv.divide_length": 8,
    "rollout.kv.control.floor": 24, "rollout.kv.control.ceiling": 64, "rollout.kv.control.align": 4,
    "algo.correction.veto": 0.3,  # the preset vetoes at 1e-4: here some sequences are rejected and rescued
    "algo.dynamic_sampling.enable": "true", "algo.dynamic_sampling.max_rounds": 2,
    "algo.correction.rescue": "dense", "algo.overlong.mask": "true",
    "actor.lora.rank": 8, "actor.lora.alpha": 16, "actor.lr": 1e-4, "trainer.save_every": 1,
    "logger.progress": "false",
}
SHOWN = ("kv/budget", "kv/budget_tail", "sampler/xi_p05", "mismatch/xi_p05", "kv/compressions",
         "sampler/rejected_seq_frac", "correction/rejected_seq_frac", "rescue/seqs", "dynamic/rounds",
         "overlong/masked_frac", "reward/mean")


def run(out: Path, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "sparserl.trainer.grpo", *[f"{k}={v}" for k, v in ARGS.items()], f"trainer.output_dir={out}", *extra]
    t0 = time.perf_counter()
    print("$", " ".join(cmd[3:]), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stdout[-3000:], res.stderr[-5000:], sep="\n")
        sys.exit(f"run {out} failed (exit {res.returncode})")
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith(("kv budget:", "old log-probs:", "resumed from", "zero-advantage")):
            print("  " + line)
    return time.perf_counter() - t0


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return {f"{p.name}:{k}": v for p in sorted((out / "hf").glob("*.safetensors")) for k, v in load_file(p).items()}


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv and "=" not in argv[0] else ROOT / "outputs" / "features_together"
    extra = [a for a in argv if "=" in a]
    full, parted = out / "full", out / "parted"
    t_full = run(full, extra + ["trainer.overwrite=true"])  # a rerun of this script starts its runs over
    t_cut = run(parted, extra + ["trainer.stop_after=2", "trainer.overwrite=true"])
    t_resume = run(parted, extra + ["trainer.resume=auto"])
    rows = metrics(full)
    print(f"\nfull run {t_full:.0f} s; stopped after 2 in {t_cut:.0f} s, resumed in {t_resume:.0f} s\n")
    print("| step | " + " | ".join(SHOWN) + " |")
    print("|" + "---|" * (len(SHOWN) + 1))
    for m in rows:
        print(f"| {m['step']} | " + " | ".join(f"{m[k]:.4g}" if isinstance(m.get(k), float) else str(m.get(k, "-"))
                                            for k in SHOWN) + " |")
    problems = []
    for m in rows:
        if m.get("kv/budget_tail") != m.get("sampler/xi_p05"):
            problems.append(f"step {m['step']}: the controller read {m.get('kv/budget_tail')}, not sampler/xi_p05")
    if not sum(m.get("kv/compressions", 0) for m in rows):
        problems.append("the engine never compressed")
    resumed = metrics(parted)
    if [m["step"] for m in resumed] != [m["step"] for m in rows]:
        problems.append(f"resumed run logged steps {[m['step'] for m in resumed]}")
    else:
        for a, b in zip(rows, resumed):
            differ = sorted(k for k in a if not k.startswith(TIMING) and a[k] != b.get(k))
            if differ:
                problems.append(f"step {a['step']} differs after the resume: {differ[:8]}")
    wa, wb = weights(full), weights(parted)
    same = wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    print(f"\nresume from step 2: metrics {'bitwise equal' if not problems else 'DIFFER'}; final weights "
          f"({len(wa)} tensors in hf/) {'bitwise equal' if same else 'DIFFER'}")
    if not same:
        problems.append("final weights differ")
    for p in problems:
        print("problem:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
