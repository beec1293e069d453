"""What the actor's memory knobs cost: one update of a GRPO-shaped batch under each setting, in a fresh process.

    python benchmarks/update_knobs.py [--model smollm2-135m-instruct] [--seqs 64] [--dtype float32]

The batch is the comparison workload's shape (train_step.py --workload mawps): 64 sequences of a ~70-token
prompt and a response of up to 128 tokens (lengths drawn once, seeded), random token ids, one optimizer step
with the fused loss (logp_old from the update's own forward). Each setting runs in its own process
(so one setting's freed memory cannot hide another's peak): a warm-up update, then a timed one. The peak is the
update phase's resident-set peak (CPU) or allocator peak (CUDA); "model + optimizer" is the memory in use
before the timed update (weights, gradients, AdamW state).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402

SETTINGS = [  # (activation checkpointing, tokens per micro-batch, logprob chunk MB)
    (False, 4096, 0), (False, 4096, 256), (True, 4096, 256), (True, 16384, 256),
]


def one(args) -> None:
    import torch

    from sparserl.actor.actor import Actor, TrainBatch
    from sparserl.algo.loss import LossConfig
    from sparserl.config import AlgoConfig
    from sparserl.parallel import ParallelDims, init_distributed
    from sparserl.actor.hf import resolve_model_path
    from sparserl.trainer.loss_path import FusedOldLogprobLoss
    from sparserl.utils.memory import PhasePeaks, release_free_memory

    info = init_distributed("cpu" if not torch.cuda.is_available() else "cuda")
    mesh = ParallelDims.from_world(1, 1).build_mesh(info.device.type)
    actor = Actor(resolve_model_path(args.model), mesh, info.device, dtype="float32", compute_dtype=args.dtype,
                  max_tokens_per_device=args.max_tokens, activation_checkpointing=args.ac, logprob_chunk_mb=args.chunk_mb)
    g = torch.Generator().manual_seed(0)
    V = actor.config.vocab_size
    prompts = torch.randint(62, 78, (args.seqs,), generator=g).tolist()
    resps = torch.clamp(torch.randint(40, 200, (args.seqs,), generator=g), max=128).tolist()
    T = max(resps)
    mask = torch.zeros(args.seqs, T)
    for i, r in enumerate(resps):
        mask[i, :r] = 1
    batch = TrainBatch(ids=[torch.randint(0, V, (p + r,), generator=g).tolist() for p, r in zip(prompts, resps)],
                       prompt_lens=prompts, mask=mask.to(info.device), advantages=torch.randn(args.seqs, generator=g).to(info.device),
                       logp_sparse=(-torch.rand(args.seqs, T, generator=g) * 5).to(info.device))
    loss_cfg = LossConfig()
    peaks = PhasePeaks(info.device)
    out = {}
    for p in actor.model.parameters():  # AdamW state exists from the start, as after a first update
        p.grad = torch.zeros_like(p)
    actor.optimizer.step()  # zero gradients: the weights do not move
    actor.optimizer.zero_grad(set_to_none=True)
    release_free_memory()
    base = peaks.current()
    peaks.start()
    t0 = time.perf_counter()
    actor.update(batch, FusedOldLogprobLoss(AlgoConfig(), loss_cfg, None), 1, 1)
    out = {"seconds": time.perf_counter() - t0, "peak_gb": peaks.stop(), "base_gb": base, "tokens": sum(map(len, batch.ids))}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-mb", type=float, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    rows = []
    for ac, max_tokens, chunk in SETTINGS:
        cmd = [sys.executable, __file__, "--one", "--model", args.model, "--seqs", str(args.seqs), "--dtype", args.dtype,
               "--max-tokens", str(max_tokens), "--chunk-mb", str(chunk)] + (["--ac"] if ac else [])
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(29600 + len(rows))}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            sys.exit(res.stderr[-3000:])
        r = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(["on" if ac else "off", max_tokens, chunk or "off", r["seconds"], r["tokens"] / r["seconds"],
                     r["base_gb"], r["peak_gb"], r["peak_gb"] - r["base_gb"]])
        print_table(["activation ckpt", "tokens/micro-batch", "logprob chunk MB", "update s", "tokens/s",
                     "model + optimizer GB", "update peak GB", "peak - base GB"], rows[-1:])
    print(f"\nmachine: {machine()}; {args.model} {args.dtype}, {args.seqs} sequences\n")
    print_table(["activation ckpt", "tokens/micro-batch", "logprob chunk MB", "update s", "tokens/s",
                 "model + optimizer GB", "update peak GB", "peak - base GB"], rows, title="one update, each setting in a fresh process")


if __name__ == "__main__":
    main()
