"""One decode step of the native engine's attention, per layer: the kernel choices side by side.

    python benchmarks/decode_attention.py                      # SmolLM2-135M shapes, batch 1 16 64
    python benchmarks/decode_attention.py --heads 32 --kv-heads 8 --head-dim 128 --length 1024

Each sequence has one query row over its cached entries, which live at scattered slots of the KV pool (the
pool is shared by all sequences and compression frees slots in place). Rows (median of `--reps` timed rounds
of 10 calls each, interleaved so that a noisy machine hurts every variant alike):

- `matmul`: gather with index_select into strided (B, H_kv, L, D) views, then grouped matmuls + softmax (the
  engine's kernel before SDPA);
- `sdpa`: the same gathered views into SDPA, the query heads of one KV head as its query rows (the engine's
  kernel now);
- `gather only`: the two index_selects alone;
- `decode cache`: `rollout.decode_cache` (the CPU default): contiguous per-sequence copies, one new entry per
  sequence copied in per call (what each layer of a decode step does), then SDPA over the contiguous rows;
- `paged kernel`: sparserl/kernels/paged_decode.py, the Triton kernel reading the pool through the slot table
  (no gather); only where it can run: `--device cuda`, or CPU with TRITON_INTERPRET=1 set (the interpreter:
  a correctness check, its time means nothing).

All variants are checked against `matmul` before timing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402
from sparserl.engines.native.decode_cache import DecodeCache  # noqa: E402
from sparserl.kernels.paged_decode import kernel_available, paged_decode_attention  # noqa: E402


def make_case(batch: int, heads: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots = batch * length + 4096
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    index = torch.randperm(slots, generator=g)[: batch * length].view(batch, length)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    valid = torch.arange(length)[None, :] < lengths[:, None]
    bias = torch.zeros(batch, 1, 1, length, dtype=dtype).masked_fill(~valid[:, None, None, :], float("-inf"))
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, index, bias


def gathered(k_cache, v_cache, index):
    b, L = index.shape
    d = k_cache.shape[-1]
    k = k_cache.index_select(0, index.reshape(-1)).view(b, L, -1, d).transpose(1, 2)
    v = v_cache.index_select(0, index.reshape(-1)).view(b, L, -1, d).transpose(1, 2)
    return k, v


def run_matmul(q, k_cache, v_cache, index, bias):
    b, h, d = q.shape
    k, v = gathered(k_cache, v_cache, index)
    qg = q.view(b, k.shape[1], h // k.shape[1], d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * d**-0.5 + bias.float()
    return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v).reshape(b, h, d)


def run_sdpa(q, k_cache, v_cache, index, bias):
    b, h, d = q.shape
    k, v = gathered(k_cache, v_cache, index)
    qg = q.view(b, k.shape[1], h // k.shape[1], d)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias).reshape(b, h, d)


def run_gather(q, k_cache, v_cache, index, bias):
    return gathered(k_cache, v_cache, index)[0]


def decode_cache_runner(q, k_cache, v_cache, index, bias):
    """The engine's `rollout.decode_cache` path: rows filled once, then each call copies in one new entry per
    sequence (what every layer of a decode step does) and attends over the contiguous rows."""
    b, L = index.shape
    lengths = [int(x) for x in (bias[:, 0, 0, :] == 0).sum(-1)]
    cache = DecodeCache(1, k_cache.shape[1], k_cache.shape[2], k_cache.dtype, k_cache.device)
    fill = [(r, c, int(index[r, c])) for r in range(b) for c in range(lengths[r])]
    cache.plan_step(*map(list, zip(*fill)), list(range(b)), lengths)
    cache.attend(0, q, k_cache, v_cache, None)
    last = [(r, lengths[r] - 1, int(index[r, lengths[r] - 1])) for r in range(b)]
    cache.plan_step(*map(list, zip(*last)), list(range(b)), lengths)

    def run(q, k_cache, v_cache, index, bias):
        return cache.attend(0, q, k_cache, v_cache, None)

    return run


def paged_runner(q, k_cache, v_cache, index, bias):
    """The Triton paged decode kernel over the same slots; lengths from the bias (computed once, like the
    engine's persistent table)."""
    lengths = (bias[:, 0, 0, :] == 0).sum(-1)

    def run(q, k_cache, v_cache, index, bias):
        return paged_decode_attention(q, k_cache, v_cache, index, lengths)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--length", type=int, default=180, help="cached entries of the longest sequence")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--device", default="cpu", help="cpu or cuda (timings synchronize the device)")
    args = p.parse_args()
    paged = kernel_available(args.device)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    rows = []
    for b in args.batch:
        case = [t.to(args.device) for t in make_case(b, args.heads, args.kv_heads, args.head_dim, args.length, dtype)]
        variants = {"matmul": run_matmul, "sdpa": run_sdpa, "gather only": run_gather,
                    "decode cache": decode_cache_runner(*case)}
        if paged:
            variants["paged kernel"] = paged_runner(*case)
        ref = run_matmul(*case).float()
        for name in ("sdpa", "decode cache") + (("paged kernel",) if paged else ()):
            err = (variants[name](*case).float() - ref).abs().max().item()
            if err > tol:
                raise SystemExit(f"{name} differs from matmul by {err:.3g} at batch {b}")
        times = {name: [] for name in variants}
        with torch.inference_mode():
            for fn in variants.values():
                fn(*case)
            for _ in range(args.reps):
                for name, fn in variants.items():
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        fn(*case)
                    sync()
                    times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append([b, med["matmul"], med["sdpa"], med["gather only"], med["decode cache"], med.get("paged kernel", "-"),
                     f"{med['matmul'] / med['sdpa']:.2f}x", f"{med['matmul'] / med['decode cache']:.2f}x"])
    print(f"# {machine()}; {args.dtype}; {args.heads} query / {args.kv_heads} KV heads, head dim {args.head_dim}, "
          f"up to {args.length} cached entries")
    print_table(["batch", "matmul ms", "sdpa ms", "gather only ms", "decode cache ms", "paged kernel ms",
                 "sdpa vs matmul", "decode cache vs matmul"], rows,
                title="decode attention, one layer (median ms)")


if __name__ == "__main__":
    main()
