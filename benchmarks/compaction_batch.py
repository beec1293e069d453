"""Compaction of many requests due at the same step: one at a time (`compact_entries`) against one batched pass
(`compact_batch`), on a random pool shaped like SmolLM2-135M's KV cache (30 layers, 3 KV heads, 9 query heads,
head dim 64, fp32 by default).

    python benchmarks/compaction_batch.py                          # 64 requests of 600 entries to 256, R-KV
    python benchmarks/compaction_batch.py --batch 16 --device cuda --shapes 3 --algorithm snapkv

Every request holds `--entries` entries (`--shapes k`: k different lengths, 8 apart, so the batch splits into k
same-shape chunks) in scattered slots of one shared pool, with a full query window, and is compacted to
`--keep`. Both ways start from the same pool and states, and every timed run checks their keep-sets and pools
equal. Rows: the best of `--repeats` timed runs after a short warm-up; "aten ops" counts the operators each way
dispatches (views left out), on a GPU about one kernel launch each.

Left out on purpose: the engines' own bookkeeping around compaction (schedules, freeing slots), which is the
same both ways.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_device, machine, print_table, sync  # noqa: E402
from sparserl.kv import KVPolicyConfig  # noqa: E402
from sparserl.kv import compaction  # noqa: E402
from sparserl.kv.compaction import CompactionState, DueRequest, QueryRing, compact_batch, compact_entries  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_world(args, device: torch.device):
    """The pool (K and V per layer), the query ring and the due requests, all random and seeded."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    lengths = [args.entries + 8 * (i % args.shapes) for i in range(args.batch)]
    num_slots = sum(lengths) + 64
    k = [torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device) for _ in range(args.layers)]
    v = [torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device) for _ in range(args.layers)]
    ring = QueryRing(args.layers, args.batch, args.window)
    ring.allocate(args.q_heads, args.head_dim, dtype, device)
    for buf in ring.buffers:
        buf.normal_()
    perm = torch.randperm(num_slots, device=device)
    starts = [sum(lengths[:i]) for i in range(args.batch)]
    due = [DueRequest(CompactionState(queries_seen=n), i, perm[s:s + n], args.keep, n)
           for i, (s, n) in enumerate(zip(starts, lengths))]
    return k, v, ring, due


def fresh(due):
    return [DueRequest(copy.deepcopy(d.state), d.row, d.slots, d.keep, d.cached) for d in due]


def one_at_a_time(cfg, ring, due, k, v):
    return [compact_entries(cfg, d.state, ring, d.row, d.slots, k, v, d.keep, d.cached) for d in due]


def batched(cfg, ring, due, k, v):
    return compact_batch(cfg, ring, due, k, v)


def timed(fn, cfg, ring, due, k, v, device) -> tuple[float, list[torch.Tensor]]:
    sync(device)
    t0 = time.perf_counter()
    kept = fn(cfg, ring, fresh(due), k, v)
    sync(device)
    return time.perf_counter() - t0, kept


def measure(cfg, world, device, repeats: int) -> tuple[list[float], list[float]]:
    """Best seconds of each way over `repeats` runs, each way on its own copy of the pool; checks them equal."""
    k, v, ring, due = world
    k2, v2 = [t.clone() for t in k], [t.clone() for t in v]
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        t_one, kept_one = timed(one_at_a_time, cfg, ring, due, k, v, device)
        t_batch, kept_batch = timed(batched, cfg, ring, due, k2, v2, device)
        same = all(torch.equal(x, y) for x, y in zip(kept_one, kept_batch))
        if not same or not all(torch.equal(x, y) for x, y in zip(k + v, k2 + v2)):
            raise SystemExit("batched compaction chose different entries than one request at a time")
        best = [min(best[0], t_one), min(best[1], t_batch)]
    return best


def count_ops(fn, cfg, ring, due, k, v) -> int:
    with CountOps() as counter:
        fn(cfg, ring, fresh(due), k, v)
    return counter.count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="requests due at the same step")
    p.add_argument("--entries", type=int, default=600, help="entries each request holds")
    p.add_argument("--shapes", type=int, default=1, help="distinct lengths among the requests")
    p.add_argument("--keep", type=int, default=256, help="entries each request keeps (the budget)")
    p.add_argument("--algorithm", default="rkv", choices=["rkv", "snapkv", "streaming"])
    p.add_argument("--share", default="head", choices=["head", "layer", "all"])
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--chunk-elements", type=int, default=0,
                   help="bound on a scoring chunk's requests * H_kv * n * n (0: the library's, which is small on CPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each way (the best is shown)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="a first untimed run of two requests each way")
    args = p.parse_args()
    device = bench_device(args.device)
    if args.chunk_elements:
        compaction.CHUNK_SCORE_ELEMENTS = compaction.CPU_CHUNK_SCORE_ELEMENTS = args.chunk_elements
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = KVPolicyConfig(algorithm=args.algorithm, budget=args.keep, window=args.window, share=args.share)
    world = make_world(args, device)
    if args.warmup:
        k, v, ring, due = world
        measure(cfg, (k, v, ring, due[:2]), device, 1)
    best = measure(cfg, world, device, args.repeats)
    k, v, ring, due = world
    # One request's operators do not depend on its length: one request's count times the batch is the whole loop's.
    ops = [count_ops(one_at_a_time, cfg, ring, due[:1], k, v) * args.batch, count_ops(batched, cfg, ring, due, k, v)]
    rows = [[name, t * 1e3, t * 1e3 / args.batch, n] for name, t, n in zip(("one at a time", "batched"), best, ops)]
    rows.append(["ratio", best[0] / best[1], "", ops[0] / ops[1]])
    bound = compaction.CPU_CHUNK_SCORE_ELEMENTS if device.type == "cpu" else compaction.CHUNK_SCORE_ELEMENTS
    print(machine())
    print_table(["compaction", "ms per step", "ms per request", "aten ops"], rows,
                title=f"{args.batch} requests of {args.entries} entries ({args.shapes} lengths) to {args.keep}, "
                      f"{args.algorithm}, share={args.share}, {args.layers} layers, {args.kv_heads} KV heads, "
                      f"{args.dtype}, {device.type}, chunk bound {bound}; same keep-sets and pools both ways")


if __name__ == "__main__":
    main()
