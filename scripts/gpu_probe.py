"""The GPU check's first stage (scripts/gpu_check.sh, at most 30 s): what the machine is, and one launch of each
Triton kernel at the shape the GPU check's model launches.

    python scripts/gpu_probe.py              # on the GPU machine
    python scripts/gpu_probe.py --dry-run    # on a CPU: the kernels under triton's interpreter, at a tiny shape

Prints, a line each as it is found: torch, CUDA, triton and transformers versions; the device, its compute
capability, free and total memory; gcc and Python.h (triton builds its launcher with them at the first launch);
the paged decode kernel's launch probe (`sparserl.kernels.paged_decode.launch_problem`: what the engine decides
at its first use); then one row per kernel launch at the Qwen2.5-1.5B decode shape (12 query heads over 2 KV
heads, D = 128, bf16) with several splits and with one: the first launch's milliseconds (compile and launcher
build included), the registers and spills the driver reports for the loaded kernel (to set against the compile
table of docs/gpu.md), and the largest difference from the torch reference.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def say(*parts) -> None:
    print(*parts, flush=True)


def toolchain() -> None:
    gcc = shutil.which(os.environ.get("CC") or "gcc")
    version = "absent"
    if gcc:
        out = subprocess.run([gcc, "--version"], capture_output=True, text=True)
        version = f"{gcc}: {out.stdout.splitlines()[0] if out.stdout else 'no version'}"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    say(f"C compiler: {version} | Python.h: {'present' if header.exists() else 'absent'} ({header})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the kernels under triton's interpreter, tiny")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before the import below
    t0 = time.perf_counter()
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparserl.kernels import paged_decode as pd

    triton_version = pd.triton.__version__ if pd.triton is not None else "not installed"
    say(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | triton {triton_version} | transformers "
        f"{transformers.__version__} | Python {sys.version.split()[0]} | {os.cpu_count()} host cores | imports "
        f"{time.perf_counter() - t0:.1f} s")
    toolchain()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        cap = torch.cuda.get_device_capability(device)
        say(f"device: {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}), {torch.cuda.device_count()} "
            f"visible, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    else:
        device = torch.device("cpu")
        say("device: no CUDA device visible" + (" (dry run: the interpreter on CPU)" if args.dry_run else ""))
    if pd.triton is None:
        say("paged decode kernel: triton is not installed; decode attention takes the SDPA path")
        return 0
    if device.type == "cuda":
        t = time.perf_counter()
        problem = pd.launch_problem(device)
        say(f"paged decode launch probe: {'passed' if problem is None else problem} ({time.perf_counter() - t:.1f} s)")
    elif not pd.kernel_available(device):
        say("paged decode kernel: not available on CPU without TRITON_INTERPRET=1")
        return 0
    heads, kv_heads, dim, dtype = (4, 2, 16, torch.float32) if args.dry_run else (12, 2, 128, torch.bfloat16)
    cases = [(2, 64, 16), (4, 48, 64)] if args.dry_run else [(8, 2048, None), (256, 512, None)]
    say("| launch | kernel | batch | width | splits | ms (first launch) | registers | spills | max abs err |")
    say("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for batch, width, split_len in cases:
        slots = batch * width + 1
        q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
        k, v = (torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype) for _ in range(2))
        table = torch.randperm(slots, generator=g)[: batch * width].view(batch, width).to(device, torch.int32)
        lengths = torch.randint(1, width + 1, (batch,), generator=g).to(device)
        out, plan = pd.launches(q, k, v, table, lengths, split_len=split_len)
        for launch in plan:
            t = time.perf_counter()
            compiled = launch.kernel[launch.grid](*launch.args, **launch.constants)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ms = 1000 * (time.perf_counter() - t)
            regs = getattr(compiled, "n_regs", None)
            spills = getattr(compiled, "n_spills", None)
            name = getattr(launch.kernel, "__name__", "kernel")
            err = "-"
            if launch is plan[-1]:  # the call's output is complete
                ref = pd.reference_decode_attention(q, k, v, table, lengths)
                err = f"{(out.float() - ref.float()).abs().max().item():.2e}"
            say(f"| {dim=}, {heads}/{kv_heads} heads, {str(dtype).removeprefix('torch.')} | {name} | {batch} | "
                f"{width} | {launch.grid[-1] if name == '_split_kernel' else '-'} | {ms:.1f} | "
                f"{'n/a' if regs is None else regs} | {'n/a' if spills is None else spills} | {err} |")
    say(f"probe done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
