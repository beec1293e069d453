"""Host memory per process while the actor is built, its weights are synced, and the final policy is exported.

    python benchmarks/host_memory.py [--model smollm2-135m-instruct] [--nproc 2] [--tp 1] [--dtype float32]

Runs `--nproc` processes under torchrun (gloo, CPU) twice, each time in fresh processes: "before" reproduces
the old behaviour (every rank reads the checkpoint, `load_on="all"`; every rank gathers every full tensor in
the actor's dtype for the engine and keeps all of them for the export), "after" the current one (rank 0 reads
the checkpoint and broadcasts it into the sharded model; the weight sync gathers in the engine's dtype; the
export keeps the gathered tensors on rank 0 only). Three phases per process:
  - start-up: `Actor(...)` until it is built and sharded;
  - weight sync: `sync_weights` into a native engine holding a bf16 copy (the engine is built beforehand,
    outside the measured phase, the same way in both runs);
  - export: the final Hugging Face export (`actor.export.export_final`; before: its old body).
For each phase the table gives the process's peak resident set (VmHWM, reset just before the phase through
/proc/self/clear_refs) and that peak minus the resident set just before the phase: the host memory the
phase itself needed. The model's size in the actor's dtype is printed for scale.
Left out on purpose: CUDA (device memory is the allocator's business; the host copies are what this measures).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("start-up", "weight sync", "export")


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_hwm() -> None:
    """Make VmHWM start again from the current resident set (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from sparserl.actor.actor import Actor
    from sparserl.actor.hf import export_hf, load_model
    from sparserl.parallel import ParallelDims, init_distributed, teardown
    from sparserl.engines.native.engine import NativeEngine
    from sparserl.engines.weight_sync import sync_weights
    from sparserl.actor.export import export_final
    from sparserl.utils.memory import release_free_memory, rss_bytes, tune_malloc

    tune_malloc()  # as the trainer's entry point does
    info = init_distributed("cpu")
    mesh = ParallelDims.from_world(info.world_size, args.tp).build_mesh("cpu")
    before = args.mode == "before"
    out: dict[str, tuple[int, int]] = {}

    class Phase:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            release_free_memory()
            dist.barrier()
            self.base = rss_bytes()
            reset_hwm()

        def __exit__(self, *exc):
            if exc[0] is None:
                out[self.name] = (self.base, vm_hwm_bytes())
                dist.barrier()

    with Phase("start-up"):
        actor = Actor(args.model, mesh, info.device, dtype=args.dtype, compute_dtype="bfloat16",
                      load_on="all" if before else "rank0")
    model_bytes = sum(p.numel() * p.element_size() for p in actor.model.parameters())  # global sizes (DTensors)
    engine = NativeEngine(load_model(args.model, "bfloat16"), num_slots=256)
    with Phase("weight sync"):
        # Before: full tensors in the actor's dtype, gathered on every rank and cast by the engine.
        named = ((k, v) for k, v in actor.full_state()) if before else actor.full_state()
        sync = sync_weights(named, engine)
    del engine
    folder = Path(args.out).with_suffix(f".{args.mode}")
    with Phase("export"):
        if before:  # the old body of export_final: every rank keeps every gathered tensor
            state = {k: v.detach().cpu() for k, v in actor.full_state()}
            if info.rank == 0:
                from transformers import AutoModelForCausalLM

                with torch.device("meta"):
                    shell = AutoModelForCausalLM.from_config(actor.config)
                export_hf(shell, None, folder / "hf", state_dict=state)
            del state
        else:
            export_final(argparse.Namespace(trainer=argparse.Namespace(output_dir=str(folder))), actor, None, info.rank)
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, {"phases": out, "sync_gb": sync["perf/weight_sync_gb"]})
    if info.rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": everyone, "model_bytes": model_bytes}))
    teardown()


def run(args, mode: str, tmp: Path) -> dict:
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--mode", mode, "--out", str(out), "--model", args.model, "--tp", str(args.tp), "--dtype", args.dtype]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"the {mode!r} run failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size; must divide the attention and KV heads "
                    "(SmolLM2-135M: 9 and 3)")
    ap.add_argument("--dtype", default="float32", help="the actor's dtype")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("before", "after"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("host_memory.py measures phases through /proc/self/clear_refs and VmHWM: it needs Linux")
    if args.worker:
        return worker(args)

    from benchmarks.common import machine, print_table
    from sparserl.actor.hf import resolve_model_path

    args.model = resolve_model_path(args.model)  # converts the offline SmolLM2 once, before any process starts
    with tempfile.TemporaryDirectory(prefix="host-memory-") as tmp:
        results = {mode: run(args, mode, Path(tmp)) for mode in ("before", "after")}
    gb = 2**30
    rows = []
    for phase in PHASES:
        for rank in range(args.nproc):
            row = [phase, rank]
            for mode in ("before", "after"):
                base, peak = results[mode]["ranks"][rank]["phases"][phase]
                row += [f"{peak / gb:.2f}", f"{(peak - base) / gb:+.2f}"]
            rows.append(row)
    size = results["after"]["model_bytes"] / gb
    print(f"\nmachine: {machine()}; {args.nproc} processes (dp={args.nproc // args.tp}, tp={args.tp}), gloo on CPU")
    print(f"model: {args.model}, actor dtype {args.dtype}: {size:.2f} GB of weights; a bf16 native engine on every rank")
    sync = {mode: ", ".join(f"{r['sync_gb']:.3f}" for r in results[mode]["ranks"]) for mode in ("before", "after")}
    print(f"perf/weight_sync_gb (bytes handed to the engine) per rank: before {sync['before']}; after {sync['after']}\n")
    print_table(["phase", "rank", "before: peak GB", "before: phase GB", "after: peak GB", "after: phase GB"], rows,
                title="host memory per process (peak resident set; phase = peak minus the resident set before the phase)")


if __name__ == "__main__":
    main()
