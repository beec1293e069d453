"""Compile the Triton kernels for GPU targets on a machine without a GPU, and read their registers and spills.

A kernel compiles at its first launch, so a compile error, or a specialization that spills registers to local
memory, would otherwise first show on a GPU. This takes the launches a call makes (`paged_decode.launches` over
CPU tensors with the dtypes and strides of the engine's call), runs triton's own binder on them (the same
specialization a launch computes: dtypes, divisibility by 16, integers equal to 1, the constexprs), and compiles
each distinct specialization through to a cubin for `GPUTarget("cuda", 90, 32)` / `("cuda", 80, 32)` with the
ptxas bundled in the triton wheel. The cubin's resource usage comes from the bundled `cuobjdump` (registers, stack
frame) and its SASS (spill stores are `STL` instructions: these kernels keep no local arrays).

    python -m sparserl.kernels.compile_check --by-shape    # the full matrix; docs/gpu.md has its last table
    python -m sparserl.kernels.compile_check --matrix engine  # the shapes the engine launches (the CI test's)

It runs with TRITON_INTERPRET unset (or 0): under the interpreter triton.language's own helpers are interpreted
functions and nothing compiles, so the CI test (whose process interprets) runs this in a subprocess.

Left out on purpose: launching anything (there is no device), autotuning (the kernels take fixed num_warps /
num_stages, triton's defaults), AMD targets.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparserl.kernels import paged_decode

TARGETS = {"sm_90": 90, "sm_80": 80}


@dataclass(frozen=True)
class Shape:
    """One model's decode attention shape: query heads, KV heads, head size, pool dtype, slot table dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    table_dtype: torch.dtype = torch.int32  # the static step's table

    def label(self) -> str:
        table = "" if self.table_dtype == torch.int32 else ", int64 table"
        return f"H={self.heads}/Hkv={self.kv_heads}, D={self.head_dim}{table}"


@dataclass
class Compiled:
    kernel: str
    target: str
    dtype: str
    shape: str
    warps: int
    registers: int
    stack_bytes: int
    spill_stores: int
    seconds: float

    def row(self) -> list:
        return [self.kernel, self.target, self.dtype, self.shape, self.warps, self.registers, self.stack_bytes,
                self.spill_stores, f"{self.seconds:.1f}"]


HEADER = ["kernel", "target", "dtype", "shape", "warps", "registers", "stack B", "spill stores", "compile s"]

# What the engine launches (the static decode step, bf16 rollouts): the GPU check's Qwen2.5-1.5B shape (12 query
# heads over 2 KV heads, D = 128) and SmolLM2-135M's (9 over 3, D = 64).
ENGINE = {"sm_90": [Shape(12, 2, 128, torch.bfloat16), Shape(9, 3, 64, torch.bfloat16)],
          "sm_80": [Shape(12, 2, 128, torch.bfloat16)]}


def full_matrix() -> list[Shape]:
    """Head sizes 64/128/256, one, six and eight query heads per KV head and MQA (32 over 1), bf16/fp16/fp32; an
    int64 table at one shape (only the table load changes)."""
    shapes = [Shape(g * hkv, hkv, d, dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)
              for d in (64, 128, 256) for g, hkv in ((1, 8), (6, 2), (8, 4), (32, 1))]
    return shapes + [Shape(12, 2, 128, torch.bfloat16, torch.int64)]


def launches_of(shape: Shape, batches, widths) -> list[paged_decode.Launch]:
    """Every launch the static step makes at these batch sizes and table widths, on CPU tensors laid out as its
    call lays them out: q (B, H, D) contiguous, pools (S, H_kv, D), a (B, W) table, (B,) int64 lengths."""
    out = []
    for B in batches:
        for W in widths:
            q = torch.empty(B, shape.heads, shape.head_dim, dtype=shape.dtype)
            pool = torch.empty(64, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
            table = torch.empty(B, W, dtype=shape.table_dtype)
            lengths = torch.empty(B, dtype=torch.int64)
            out += paged_decode.launches(q, pool, pool, table, lengths)[1]
    return out


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


class Compiler:
    """Compiles launches for targets, once per distinct specialization (the binder's, as a launch computes it)."""

    def __init__(self) -> None:
        import triton

        if triton.knobs.runtime.interpret:  # then triton.language's own @jit helpers are interpreted functions too
            raise RuntimeError("the compile check needs TRITON_INTERPRET unset or 0 when triton is imported")
        self.done: dict = {}  # specialization key -> Compiled
        self._binders: dict = {}  # (kernel, arch) -> (target, backend, binder)

    def specialize(self, launch: paged_decode.Launch, arch: int):
        """(key, target, compile source, options) of a launch, as `JITFunction.run` derives them for its device."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        fn = launch.kernel
        if (fn, arch) not in self._binders:
            target = GPUTarget("cuda", arch, 32)
            backend = make_backend(target)
            self._binders[fn, arch] = target, backend, create_function_from_signature(fn.signature, fn.params, backend)
        target, backend, binder = self._binders[fn, arch]
        bound, specialization, options = binder(*launch.args, **launch.constants)
        key = (fn.__name__, arch, repr(specialization), repr(options))
        options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.constants), bound,
                                                              specialization, options)
        return key, target, ASTSource(fn, signature, constexprs, attrs), options

    def compile(self, launch: paged_decode.Launch, target_name: str, shape: Shape) -> tuple[Compiled, bool]:
        """Compile one launch for a target: (its row, whether it was compiled now rather than an equal
        specialization before, whose row it then shares)."""
        from triton.compiler import compile as triton_compile

        key, target, src, options = self.specialize(launch, TARGETS[target_name])
        if key in self.done:
            return self.done[key], False
        t0 = time.perf_counter()
        kernel = triton_compile(src, target=target, options=options.__dict__)
        seconds = time.perf_counter() - t0
        regs, stack, stl = resource_usage(kernel.asm["cubin"], key[0])
        splits = "1 split" if launch.constants.get("ONE_SPLIT") else "splits"
        name = key[0] if key[0] != "_split_kernel" else f"_split_kernel ({splits})"
        self.done[key] = Compiled(name, target_name, str(shape.dtype).removeprefix("torch."), shape.label(),
                                  kernel.metadata.num_warps, regs, stack, stl, seconds)
        return self.done[key], True


def resource_usage(cubin: bytes, function: str) -> tuple[int, int, int]:
    """(registers, stack frame bytes, spill store instructions) of `function` in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True)
        m = re.search(rf"Function {re.escape(function)}:\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)",
                      usage.stdout)
        if m is None:
            raise RuntimeError(f"no resource usage for {function} in cuobjdump's output:\n{usage.stdout}")
        regs, stack, local = (int(x) for x in m.groups())
        spills = 0
        if stack or local:  # without a stack frame or local memory there is nowhere to spill to (and -sass is slow)
            sass = subprocess.run([_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True)
            spills = len(re.findall(r"\bSTL(\.\w+)*\s", sass.stdout))
    return regs, stack, spills


def run(matrix: str, targets: list[str], batches, widths, out=sys.stdout) -> tuple[list[Compiled], list[Compiled]]:
    """Compile the matrix for the targets, printing each row of the table as it is measured. Returns the rows
    compiled, and every (shape, kernel, target)'s row (a kernel another shape compiled shares its row)."""
    print("| " + " | ".join(HEADER) + " |", file=out)
    print("|" + "|".join("---" for _ in HEADER) + "|", file=out, flush=True)
    compiler, rows, per_shape = Compiler(), [], {}
    for target_name in targets:
        shapes = ENGINE.get(target_name, []) if matrix == "engine" else full_matrix()
        for shape in shapes:
            dtype = str(shape.dtype).removeprefix("torch.")
            for launch in launches_of(shape, batches, widths):
                row, fresh = compiler.compile(launch, target_name, shape)
                per_shape.setdefault((dtype, shape.label(), row.kernel, target_name),
                                     dataclasses.replace(row, dtype=dtype, shape=shape.label()))
                if fresh:
                    rows.append(row)
                    print("| " + " | ".join(str(x) for x in row.row()) + " |", file=out, flush=True)
    return rows, list(per_shape.values())


KERNELS = ["_split_kernel (splits)", "_split_kernel (1 split)", "_merge_kernel"]


def by_shape(rows: list[Compiled], targets: list[str], out=sys.stdout) -> None:
    """The rows again, one line per (dtype, shape): each kernel's registers per target, the split kernel's warps
    (the merge runs four), and the largest stack frame and spill count over them (the table in docs/gpu.md)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r.dtype, r.shape), {})[r.kernel, r.target] = r
    heads = ["split, several splits", "split, one split", "merge"]  # KERNELS
    print(f"\nRegisters per target ({' / '.join(targets)}):\n", file=out)
    print("| dtype | shape | " + " | ".join(heads) + " | split warps | stack B, spill stores (max) |", file=out)
    print("|" + "|".join("---" for _ in range(len(heads) + 4)) + "|", file=out)
    for (dtype, shape), got in cells.items():
        regs = [" / ".join(str(got[k, t].registers) if (k, t) in got else "-" for t in targets) for k in KERNELS]
        warps = sorted({r.warps for r in got.values() if r.kernel != "_merge_kernel"})
        worst = max(got.values(), key=lambda r: (r.stack_bytes, r.spill_stores))
        print(f"| {dtype} | {shape} | " + " | ".join(regs) + f" | {'/'.join(map(str, warps))} | "
              f"{worst.stack_bytes}, {worst.spill_stores} |", file=out, flush=True)


def main(argv: list[str] | None = None) -> int:
    import triton

    from sparserl.engines.native.graph_step import WIDTH_STEP, bucket_sizes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", choices=["full", "engine"], default="full")
    ap.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    ap.add_argument("--json", type=Path, help="also write the rows here (the CI test reads them)")
    ap.add_argument("--by-shape", action="store_true", help="then the same rows, one line per dtype and shape")
    args = ap.parse_args(argv)
    batches, widths = bucket_sizes(256), [WIDTH_STEP, 4 * WIDTH_STEP, 64 * WIDTH_STEP]
    print(f"triton {triton.__version__}, ptxas {_bin('ptxas')}; launches of the static step at batch sizes "
          f"{batches[0]}-{batches[-1]} and table widths {widths} (one row per distinct specialization)", flush=True)
    t0 = time.perf_counter()
    rows, per_shape = run(args.matrix, args.targets, batches, widths)
    spilling = [r for r in rows if r.stack_bytes or r.spill_stores]
    print(f"{len(rows)} compiled in {time.perf_counter() - t0:.0f} s; {len(spilling)} with a stack frame or spill "
          "stores", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    if args.by_shape:
        by_shape(per_shape, args.targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
