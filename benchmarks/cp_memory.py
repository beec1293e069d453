"""Peak memory per process and time of one actor update on one long sequence, with and without context parallelism.

    python benchmarks/cp_memory.py [--lengths 4096 8192 16384] [--layouts 1x1 1x2 2x1] [--no-ac]
                                   [--model smollm2-135m-instruct] [--budget-gb 24]

A layout `DPxCP` runs DP x CP processes under torchrun (gloo, CPU), each DP rank training on its own sequence of
`L` tokens (a 128-token prompt and an `L - 128`-token response): `1x1` is one process with the whole sequence,
`1x2` splits it over two cp ranks (ring attention), `2x1` is two processes with a whole sequence each (what two
processes hold without cp). Every run is a fresh set of processes and does what the trainer does for one update
of the actor (fp32, the default activation checkpointing unless `--no-ac`, the chunked LM head): forward +
backward of the token-mean GRPO loss and the AdamW step (the old log-probs are zeros: their values change neither
time nor memory). Printed per run: the update's seconds (forward + backward + step, the slowest rank); each
process's peak resident set during the update (VmHWM reset just before it: parameters, gradients, AdamW state,
activations), the processes' sum and whether it fits in `--budget-gb`; and the largest peak over a process's whole
life (loading included). A layout whose sum, scaled linearly from its last run's, would pass the budget is not run at that
length (memory grows at most linearly with the length here: the attention kernels keep no (length x length)
buffer), so nothing is driven into the out-of-memory killer. The last table names, per layout, the longest of
the lengths run whose sum fits.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402
from benchmarks.host_memory import reset_hwm, vm_hwm_bytes  # noqa: E402

PROMPT = 128


def vm_hwm_gb() -> float:
    return vm_hwm_bytes() / 2**30


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from sparserl.actor.actor import Actor, TrainBatch
    from sparserl.actor.hf import resolve_model_path
    from sparserl.algo.loss import LossConfig
    from sparserl.parallel import ParallelDims, init_distributed, teardown
    from sparserl.trainer.loss import make_loss_fn
    from sparserl.utils.memory import release_free_memory, tune_malloc

    tune_malloc()  # as the trainer's entry point does
    info = init_distributed("cpu")
    dims = ParallelDims(dp=args.dp, cp=args.cp, tp=1)
    mesh = dims.build_mesh("cpu")
    dp_rank = mesh["dp"].get_local_rank()
    actor = Actor(resolve_model_path(args.model), mesh, info.device, dtype="float32", compute_dtype="float32",
                  max_tokens_per_device=args.length, activation_checkpointing=not args.no_ac)
    g = torch.Generator().manual_seed(dp_rank)
    resp = args.length - PROMPT
    vocab = actor.config.vocab_size
    batch = TrainBatch(ids=[torch.randint(0, vocab, (args.length,), generator=g).tolist()], prompt_lens=[PROMPT],
                       mask=torch.ones(1, resp), advantages=torch.ones(1), logp_old=torch.zeros(1, resp))
    loss_fn = make_loss_fn(LossConfig(loss_agg="token", clip_low=0.2, clip_high=0.28))
    life = vm_hwm_gb()
    release_free_memory()
    reset_hwm()
    dist.barrier()
    t0 = time.perf_counter()
    actor.accumulate_gradients(batch, loss_fn, [0], with_entropy=False)
    _, applied = actor._step()
    seconds = time.perf_counter() - t0
    res = {"seconds": seconds, "peak_gb": vm_hwm_gb(), "life_gb": max(life, vm_hwm_gb()), "applied": applied}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if info.rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
    teardown()


def run(args, dp: int, cp: int, length: int, out: Path) -> list[dict] | str:
    n = dp * cp
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))  # the same cores in every layout
    common = [__file__, "--worker", "--dp", str(dp), "--cp", str(cp), "--length", str(length), "--out", str(out),
              "--model", args.model] + (["--no-ac"] if args.no_ac else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *common]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-3:]
        return f"failed (rc {res.returncode}): {' | '.join(tail)}"
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "2x1"], help="DPxCP")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--no-ac", action="store_true", help="without activation checkpointing")
    p.add_argument("--budget-gb", type=float, default=24.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts]
    print(f"machine: {machine()}; model {args.model}, fp32, activation checkpointing {'off' if args.no_ac else 'on'}",
          flush=True)
    rows, fits, last = [], {lay: None for lay in layouts}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for length in sorted(args.lengths):
            for dp, cp in layouts:
                name = f"dp={dp} cp={cp} ({dp * cp} proc)"
                if (dp, cp) in last and last[(dp, cp)][1] * length / last[(dp, cp)][0] > args.budget_gb:
                    projected = last[(dp, cp)][1] * length / last[(dp, cp)][0]
                    rows.append([length, name, "-", "-", f"{projected:.1f} (projected)", "no (not run)", "-"])
                    print(f"  {length} tokens, {name}: not run, projected {projected:.1f} GiB", flush=True)
                    continue
                res = run(args, dp, cp, length, Path(tmp) / f"{dp}x{cp}_{length}.json")
                if isinstance(res, str):
                    rows.append([length, name, "-", "-", "-", res, "-"])
                else:
                    peaks = [r["peak_gb"] for r in res]
                    total = sum(peaks)
                    last[(dp, cp)] = (length, total)
                    ok = total <= args.budget_gb
                    if ok:
                        fits[(dp, cp)] = length
                    rows.append([length, name, f"{max(r['seconds'] for r in res):.1f}",
                                 " / ".join(f"{x:.2f}" for x in peaks), f"{total:.2f}", "yes" if ok else "no",
                                 f"{max(r['life_gb'] for r in res):.2f}"])
                print(f"  {length} tokens, {name}: {rows[-1][2:]}", flush=True)
    print_table(["tokens / sequence", "layout", "update s", "update peak GiB per process", "sum GiB",
                 f"fits {args.budget_gb:g} GiB", "life peak GiB"], rows, title="One actor update on one long sequence per DP rank")
    print_table(["layout", f"longest length run that fits {args.budget_gb:g} GiB"],
                [[f"dp={dp} cp={cp}", "-" if v is None else v] for (dp, cp), v in fits.items()])


if __name__ == "__main__":
    main()
