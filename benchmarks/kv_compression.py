"""Dense vs compressed rollouts in the native engine or in SGLang: KV memory, concurrency, throughput, mismatch KL.

    python benchmarks/kv_compression.py --requests 64 --new-tokens 1024 --budgets 128 256
    python benchmarks/kv_compression.py --engine sglang ...   # in the SGLang environment (docs/sglang.md)

With `--engine sglang` every row starts its own SGLang engine (the policy is fixed at start-up) with the same
pool, running the `sparserl_kv` backend over torch_native on CPU; the engine start is not timed.

Every configuration decodes the same prompts (GSM8K questions in the chat template) with the same seeds at
temperature 1, ignoring EOS so each sequence reaches `--new-tokens` and compression really runs. The KV pool
is fixed for all rows: room for `--dense-slots-for` dense requests. Columns:
- KV / seq: the most KV bytes one sequence held at once (all layers, K and V), mean and max over sequences;
  this is what compression bounds, and "vs dense" compares the means;
- pool peak: high-water mark of the shared pool in bytes; admission fills the fixed pool in every row, so this
  column stays near the pool size and the gain shows up as more sequences running in it;
- running: most sequences decoding at once under that pool;
- KL: mean over sampled tokens of logp_sparse - logp_dense, where logp_dense is a full-attention recompute
  of the same tokens with the same weights (an unbiased estimate of KL(sparse || dense) per token).
With `--engine sglang`, plain SGLang (the `dense` row) reports no pool counters: SGLang admits requests by its
own estimate and retracts some when the pool runs out, and its running count and pool high-water mark are not
exposed. `--dense backend` (or `both`, the default there) adds a `dense (backend)` row: the `sparserl_kv`
backend with a budget above every sequence's length, which never compresses (same tokens and log-probs as
plain SGLang: tests/sglang/test_kv_backend.py) but admits by the dense bound and counts the scheduler's running
requests and slots. Columns it cannot measure show `-`.
The second table times decode steps with compression configured but never triggered (budget above the
sequence length) against dense, the overhead of capturing queries.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_device, gsm8k_prompts, log_ratios, machine, print_table  # noqa: E402
from sparserl.actor.hf import load_model, load_tokenizer  # noqa: E402
from sparserl.utils import precision  # noqa: E402
from sparserl.kv import KVPolicyConfig  # noqa: E402
from sparserl.model.attention import use_packed_attention  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402


def run(model, tokenizer, prompts, kv, num_slots, new_tokens, max_num_seqs=256, engine_kind="native", dtype="float32"):
    if engine_kind == "sglang":
        engine = start_sglang(model, tokenizer, kv, num_slots, max_num_seqs, dtype)
    else:
        # Worst-case reservation, as the tables in docs/kv_compression.md were measured: with ignore_eos every
        # sequence reaches its worst case, where optimistic admission would only retract and recompute.
        engine = NativeEngine(model, tokenizer, num_slots=num_slots, max_num_seqs=max_num_seqs, kv=kv, seed=0,
                              admission="reserve")
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    try:
        t0 = time.perf_counter()
        gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
        return gens, engine.stats(), time.perf_counter() - t0
    finally:
        if engine_kind == "sglang":
            engine.close()


def start_sglang(model, tokenizer, kv, num_slots, max_num_seqs, dtype):
    import dataclasses

    from sparserl.engines.sglang.engine import SGLangEngine, SGLangOptions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = SGLangOptions(device=device, dtype=dtype, attention_backend="torch_native" if device == "cpu" else None,
                            max_total_tokens=num_slots, max_running_requests=max_num_seqs, chunked_prefill_size=8192,
                            kv=dataclasses.asdict(kv) if kv is not None else None)
    return SGLangEngine(model.sglang_path, options, tokenizer, seed=0)


def mismatch_kl(model, gens, batch_tokens=4096):
    """Mean of logp_sparse - logp_dense over all sampled tokens (dense = full-attention recompute)."""
    ratios = log_ratios(model, gens, batch_tokens)
    return float(ratios.sum()) / max(ratios.numel(), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the hardware runs it fast, else fp32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--policies", nargs="*", default=["rkv", "snapkv", "streaming"])
    ap.add_argument("--dense", choices=["plain", "backend", "both"], default=None,
                    help="dense rows: plain engine, the sglang backend that never compresses, or both "
                         "(default: plain for native, both for sglang)")
    ap.add_argument("--divide-length", type=int, default=128)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--dense-slots-for", type=int, default=8, help="pool size: this many dense requests")
    ap.add_argument("--overhead-requests", type=int, default=32, help="0: skip the overhead table")
    ap.add_argument("--overhead-tokens", type=int, default=128)
    ap.add_argument("--engine", default="native", choices=["native", "sglang"])
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="the native engine's device")
    args = ap.parse_args()
    args.device = bench_device(args.device)
    args.dtype = precision.resolve_arg(args.dtype, args.device)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.dtype, args.device if args.engine == "native" else "cpu")
    use_packed_attention(model)
    if args.engine == "sglang":
        from sparserl.actor.hf import resolve_model_path

        model.sglang_path = resolve_model_path(args.model)
    prompts = gsm8k_prompts(tokenizer, args.requests)
    longest = max(len(p) for p in prompts)
    pool = args.dense_slots_for * (longest + args.new_tokens)
    print(f"machine: {machine()}\nengine: {args.engine}; model: {args.model} ({args.dtype}); {args.requests} requests x {args.new_tokens} new tokens; "
          f"prompts {min(len(p) for p in prompts)}-{longest} tokens; pool {pool} slots (= {args.dense_slots_for} dense requests)\n",
          flush=True)
    dense = args.dense or ("both" if args.engine == "sglang" else "plain")
    if dense != "plain" and args.engine != "sglang":
        ap.error("--dense backend|both is for --engine sglang")
    never = KVPolicyConfig(algorithm="rkv", budget=longest + args.new_tokens + 1, window=args.window,
                           divide_length=args.divide_length)
    configs = ([("dense", None)] if dense != "backend" else []) + ([("dense (backend)", never)] if dense != "plain" else [])
    configs += [(f"{p} b={b}", KVPolicyConfig(algorithm=p, budget=b, window=args.window, divide_length=args.divide_length))
                for b in args.budgets for p in args.policies]
    rows = []
    dense_seq = dense_tps = None
    for name, kv in configs:
        gens, st, wall = run(model, tokenizer, prompts, kv, pool, args.new_tokens, engine_kind=args.engine,
                             dtype=str(args.dtype))
        tps = st.new_tokens / wall
        kl = mismatch_kl(model, gens)
        retained = sum(g.kv.retained_tokens for g in gens) / max(1, sum(g.kv.total_tokens for g in gens))
        per_seq = [g.kv.peak_slots * st.kv_bytes_per_slot for g in gens]
        seq_mean, seq_max = sum(per_seq) / len(per_seq), max(per_seq)
        if dense_seq is None:  # the first row is a dense one: the reference of the "vs dense" columns
            dense_seq, dense_tps = seq_mean, tps
        counted = not (args.engine == "sglang" and kv is None)  # plain SGLang exposes no pool counters
        rows.append([name, f"{seq_mean / 2**20:.1f} / {seq_max / 2**20:.1f}", f"{seq_mean / dense_seq:.1%}",
                     f"{st.peak_kv_bytes / 2**20:.0f}" if counted else "-", st.peak_running if counted else "-",
                     f"{tps:.1f}", f"{tps / dense_tps:.2f}x", f"{retained:.1%}", st.compressions, f"{st.compress_s:.1f}",
                     f"{kl:.4f}"])
        print(rows[-1], flush=True)
    print()
    print_table(["config", "KV / seq MiB (mean / max)", "vs dense", "pool peak MiB", "running", "new tok/s", "vs dense",
                 "retained", "compressions", "compress s", "KL(sparse||dense)/tok"], rows, title="fixed pool")
    if args.overhead_requests == 0:
        return
    # Overhead without triggers: same batch, budget above every sequence's length.
    prompts_o = prompts[: args.overhead_requests]
    big = 10 * (longest + args.overhead_tokens)
    orow = []
    for name, kv in [("dense", None), ("rkv, never triggered", KVPolicyConfig(algorithm="rkv", budget=big, window=args.window))]:
        best = None
        for _ in range(3):
            _, st, wall = run(model, tokenizer, prompts_o, kv, big * len(prompts_o), args.overhead_tokens,
                              engine_kind=args.engine, dtype=str(args.dtype))
            # SGLang does not count its forwards; all requests run at once there, so a step is a new token each.
            step_ms = 1000 * st.generate_s / (st.forward_steps or args.overhead_tokens)
            best = step_ms if best is None else min(best, step_ms)
        orow.append([name, f"{best:.1f}"])
    orow[1].append(f"{float(orow[1][1]) / float(orow[0][1]) - 1:+.1%}")
    orow[0].append("")
    print()
    print_table(["decode steps", "ms / step (best of 3)", "vs dense"], orow,
                title=f"{args.overhead_requests} requests x {args.overhead_tokens} tokens, compression configured, no trigger")


if __name__ == "__main__":
    main()
