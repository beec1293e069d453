"""KV dtypes (`rollout.kv_dtype`) at one fixed KV memory in the native engine: entries held, concurrency, throughput
and the mismatch the pool's dtype adds, dense and with R-KV.

    python benchmarks/kv_dtype.py                       # 16 GSM8K prompts x 256 new tokens, auto / fp32 / int8 / fp8
    python benchmarks/kv_dtype.py --kv-dtypes auto int8 --budgets 128 --requests 32

Every row decodes the same prompts with the same seeds at temperature 1, ignoring EOS, in a pool of the same bytes:
`--dense-for` dense sequences of the longest prompt + `--new-tokens` in the model's dtype (so `auto` holds exactly
that many, int8 about twice as many in bf16). Admission is optimistic (the engine's default). Columns:
- B / entry: one token's keys and values in every layer, scales included (`utils/kv_memory.py` entry_bytes);
- entries / MB and pool entries: what the fixed memory holds in that dtype;
- running: most sequences decoding at once; retractions: sequences that gave their KV back and were prefilled again;
- KL/tok: mean of logp_sampler - logp_dense over the sampled tokens, logp_dense a full-attention recompute of the
  same tokens with the same weights in the model's dtype (the trainer's `mismatch/kl` without a weight update);
- xi_p05: the 5th percentile of xi = p_dense / p_sampler over those tokens (`mismatch/xi_p05`), |log xi| max.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_device, gsm8k_prompts, log_ratios, machine, print_table  # noqa: E402
from sparserl.actor.hf import load_model, load_tokenizer, parse_dtype  # noqa: E402
from sparserl.utils.kv_memory import entry_bytes  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.native.runner import kv_geometry  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402
from sparserl.kv import KVPolicyConfig  # noqa: E402
from sparserl.kv.kv_dtype import resolve_kv_dtype  # noqa: E402
from sparserl.model.attention import use_packed_attention  # noqa: E402
from sparserl.utils import precision  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", help="the model's dtype; auto: bf16 where the hardware runs it fast")
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp32", "int8", "fp8"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budgets", type=int, nargs="*", default=[128], help="R-KV rows at these budgets (none: dense only)")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--divide-length", type=int, default=64)
    ap.add_argument("--dense-for", type=int, default=4, help="the KV memory: this many dense sequences in the model's dtype")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args()
    device = bench_device(args.device)
    dtype = precision.resolve_arg(args.dtype, device)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype, device)
    use_packed_attention(model)
    prompts = gsm8k_prompts(tokenizer, args.requests)
    longest = max(len(p) for p in prompts)
    geometry = kv_geometry(model.config)

    def entry(kv_dtype: str) -> int:
        return entry_bytes(*geometry, *resolve_kv_dtype(kv_dtype, parse_dtype(dtype)).element_and_scale_bytes())

    memory = args.dense_for * (longest + args.new_tokens - 1) * entry("auto")
    print(f"machine: {machine()}\nmodel: {args.model} ({dtype}) on {device}; {args.requests} requests x {args.new_tokens} new "
          f"tokens; prompts {min(len(p) for p in prompts)}-{longest} tokens; KV memory {memory / 2**20:.1f} MB "
          f"(= {args.dense_for} dense sequences in {dtype})\n", flush=True)
    policies = [("dense", None)] + [(f"rkv b={b}", KVPolicyConfig(algorithm="rkv", budget=b, window=args.window,
                                                                  divide_length=args.divide_length))
                                    for b in args.budgets]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    rows = []
    for name, kv in policies:
        for kv_dtype in args.kv_dtypes:
            per_entry = entry(kv_dtype)
            engine = NativeEngine(model, tokenizer, num_slots=memory // per_entry, kv=kv, seed=0, kv_dtype=kv_dtype)
            t0 = time.perf_counter()
            gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
            wall = time.perf_counter() - t0
            st = engine.stats()
            engine.sleep()  # the pool goes; the weights stay for the next rows and the recompute
            ratio = log_ratios(model, gens)
            xi = torch.exp(-ratio.double())
            rows.append([name, kv_dtype, per_entry, f"{2**20 / per_entry:.0f}", memory // per_entry, st.peak_running,
                         st.retractions, f"{st.new_tokens / wall:.1f}", f"{ratio.mean():.5f}",
                         f"{torch.quantile(xi, 0.05):.4f}", f"{ratio.abs().max():.3f}"])
            print(rows[-1], flush=True)
    print()
    print_table(["config", "kv_dtype", "B / entry", "entries / MB", "pool entries", "running", "retractions",
                 "new tok/s", "KL/tok", "xi_p05", "|log xi| max"], rows,
                title=f"one KV memory, {memory / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
