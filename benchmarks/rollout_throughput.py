"""New tokens/s of the rollout engines vs transformers `generate` (static batch), same model/prompts/lengths, and
the matmul floor they are measured against.

    python benchmarks/rollout_throughput.py --batch 8 64 --new-tokens 128 --dtype float32
    python benchmarks/rollout_throughput.py --engine native sglang   # in an environment with SGLang (docs/sglang.md)
    python benchmarks/rollout_throughput.py --engine native native:gather   # rollout.decode_cache auto (default) / off
    python benchmarks/rollout_throughput.py --engine native native:plain    # rollout.prepack auto (default) / off
    python benchmarks/rollout_throughput.py --device cuda --engine native:eager native:graphs --repeats 2
        # rollout.cuda_graphs off / on (auto = on for CUDA): eager decode steps vs captured ones, both vs HF generate;
        # a graph engine is warmed up at each batch size first, and the best of the repeats leaves out the captures
        # of buckets first met in a timed run
    python benchmarks/rollout_throughput.py --quantization none int8 --batch 1 16 64 --new-tokens 64

`--quantization` compares quantized native engines instead (docs/quantization.md): new tokens/s per batch
(prefill included), the engine's weight memory, and the mismatch KL (mean of logp_sparse - logp_dense over
response tokens, the trainer's `mismatch/kl`) against dense log-probs of the same tokens from an unquantized
model in `--trainer-dtype`, computed the way the actor computes them. `int8:dequant` forces the
dequantize-per-matmul kernel instead of torch's fused int8 one. `--kv-budget N` adds R-KV rows with the dense
re-score split (`rollout/kv_mismatch_kl`: the compression's share of the KL).

The floor (`benchmarks/common.py::matmul_floor`) is the same workload's GEMMs, timed in the same run, back to back
with nothing else: the prompts' prefill (every linear layer but the LM head at M = the prefill forward's tokens,
packed as the engine packs them, the LM head at M = the batch) then `new_tokens - 1` decode steps (every linear
layer at M = the batch). `floor tok/s` is new tokens over that time; `decode` columns count only the decode steps
(the native engine's: `generate` of `new_tokens` minus `generate` of 1 token, the prefill's share). Attention,
norms, RoPE, activations and sampling are outside the floor, so no engine reaches it. In float32 on CPU the table
also prints `packed floor decode tok/s`: the decode step's GEMMs with every weight packed for M = the batch first
and, with oneDNN's layout, q/k/v and gate/up as one GEMM each (`benchmarks/common.py::packed_matmul_floor`), the
faster GEMMs the native engine's decode steps run with
`rollout.prepack` (engines/native/prepack.py), and each engine's decode rate as a share of it.

All sample at temperature 1 and ignore EOS, so every sequence produces exactly `--new-tokens` tokens and
the two engines do the same useful work. The `eos` rows let sequences stop at EOS (capped at the same
length): there continuous batching also skips the finished rows that a static batch keeps computing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (bench_device, gsm8k_prompts, machine, matmul_floor, packed_matmul_floor,  # noqa: E402
                               print_table, sync)
from sparserl.engines.native.prepack import prepack_available  # noqa: E402
from sparserl.actor.hf import load_model, load_tokenizer, resolve_model_path  # noqa: E402
from sparserl.utils import precision  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402


MAX_BATCH_TOKENS = 8192  # the native engine's (and NativeOptions') default


def hf_generate(model, tokenizer, prompts, new_tokens, ignore_eos):
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             min_new_tokens=new_tokens if ignore_eos else 0, pad_token_id=tokenizer.pad_token_id)
    sync(device)
    dt = time.perf_counter() - t0
    gen = out[:, batch["input_ids"].shape[1]:].cpu()
    if ignore_eos:
        n = gen.numel()
    else:  # count tokens up to and including the first EOS
        is_eos = gen == tokenizer.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full((gen.shape[0],), gen.shape[1]))
        n = int(first.sum())
    return n, dt


def prefill_rows(prompts: list[list[int]], max_batch_tokens: int) -> list[int]:
    """Tokens per prefill forward: whole prompts packed in order while they fit, as the native scheduler admits them."""
    rows = [0]
    for p in prompts:
        if rows[-1] and rows[-1] + len(p) > max_batch_tokens:
            rows.append(0)
        rows[-1] += len(p)
    return rows


def floors(model, prompts, new_tokens, max_batch_tokens) -> tuple[float, float]:
    """(prefill floor s, one decode step's floor s) for this batch."""
    b = len(prompts)
    return (matmul_floor(model, prefill_rows(prompts, max_batch_tokens), [b], repeats=2),
            matmul_floor(model, [b], [b]))


def engine_generate(engine, prompts, new_tokens, ignore_eos):
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=ignore_eos, seed=0)
    t0 = time.perf_counter()
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


def quantized_run(args, tokenizer, trainer, scheme: str, kv_budget: int) -> list[list]:
    """One engine per (scheme, KV setting): tok/s, weight MB and mismatch KL at every batch size."""
    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs
    from sparserl.kv import KVPolicyConfig

    quant, _, kernel = scheme.partition(":")
    kv = KVPolicyConfig(algorithm="rkv", budget=kv_budget, divide_length=16, window=8, compress_prompt=True) if kv_budget else None
    engine = NativeEngine(load_model(args.model, args.dtype, args.device), tokenizer, num_slots=max(args.batch) * 512, quantization=quant,
                          quant_kernel=kernel or "auto", kv=kv, rescore_seqs=8 if kv_budget else 0)
    engine_generate(engine, gsm8k_prompts(tokenizer, 2), 4, True)  # warm-up
    name = f"{quant} ({engine.runner.quant.kernel})" if engine.runner.quant is not None else "none"
    rows = []
    for b in args.batch:
        prompts = gsm8k_prompts(tokenizer, b)
        engine.reset_stats()
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
        t0 = time.perf_counter()
        gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
        dt = time.perf_counter() - t0
        n = sum(len(g.token_ids) for g in gens)
        seqs = PackedSeqs([g.prompt_token_ids + g.token_ids for g in gens], [len(g.prompt_token_ids) for g in gens])
        with torch.inference_mode():
            dense, _ = packed_logprobs(trainer, seqs, next(trainer.parameters()).device)  # (b, T)
        sparse = torch.tensor([g.logp_sparse for g in gens])  # every response has new_tokens tokens
        diff = sparse - dense.float().cpu()
        extra = engine.stats().extra
        rows.append([name, f"rkv {kv_budget}" if kv_budget else "dense", b, n, n / dt, extra["rollout/weight_bytes"] / 2**20,
                     float(diff.mean()), float(diff.abs().mean()),
                     f"{extra['rollout/kv_mismatch_kl']:.3g}" if "rollout/kv_mismatch_kl" in extra else "-"])
        print(rows[-1], flush=True)
    del engine
    return rows


def quantization_table(args, tokenizer) -> None:
    trainer = load_model(args.model, args.trainer_dtype, args.device)
    print(f"machine: {machine()}\nmodel: {args.model}, rollout dtype {args.dtype}, trainer dtype {args.trainer_dtype}, "
          f"{args.new_tokens} new tokens per sequence, temperature 1\n")
    rows = []
    for budget in [0] + ([args.kv_budget] if args.kv_budget else []):
        for scheme in args.quantization:
            rows += quantized_run(args, tokenizer, trainer, scheme, budget)
    base = {(r[1], r[2]): r[4] for r in rows if r[0] == "none"}
    for r in rows:
        r.insert(5, f"{r[4] / base[(r[1], r[2])]:.2f}x" if (r[1], r[2]) in base else "-")
    print()
    print_table(["quantization (kernel)", "kv", "batch", "tokens", "tok/s", "vs none", "weights MiB", "mismatch KL",
                 "mean |dlogp|", "KV share (re-score)"], rows)


def start_sglang(model: str, dtype: str, max_batch: int, tokenizer):
    from sparserl.engines.sglang.engine import SGLangEngine, SGLangOptions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The native engine's pool size and batch limit, so both engines may run every sequence at once.
    options = SGLangOptions(device=device, dtype=dtype, attention_backend="torch_native" if device == "cpu" else None,
                            max_total_tokens=max_batch * 512, max_running_requests=max_batch, cuda_graph=device == "cuda")
    return SGLangEngine(resolve_model_path(model), options, tokenizer, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the hardware runs it fast, else fp32")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["fixed"], choices=["fixed", "eos"])
    ap.add_argument("--engine", nargs="+", default=["native"], choices=["native", "native:gather", "native:plain", "native:eager", "native:graphs", "sglang"],
                help="native: the engine's defaults (rollout.decode_cache=auto: contiguous decode K/V copies on CPU; "
                     "rollout.prepack=auto: float32 CPU weights packed for the decode batch); "
                     "native:gather: rollout.decode_cache=off (decode gathers every sequence's K/V per layer); "
                     "native:plain: rollout.prepack=off (plain GEMMs); native:eager / native:graphs: "
                     "rollout.cuda_graphs=off / on (decode-only steps over static buffers, captured on CUDA)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quantization", nargs="+", default=[],
                    help="compare native engines with these rollout.quantization values (none, int8, int8:dequant, w8a8, fp8)")
    ap.add_argument("--trainer-dtype", default="auto", help="dtype of the dense reference log-probs (--quantization)")
    ap.add_argument("--kv-budget", type=int, default=0, help="--quantization: also run with R-KV at this budget")
    args = ap.parse_args()
    args.device = bench_device(args.device)
    args.dtype = precision.resolve_arg(args.dtype, args.device)
    args.trainer_dtype = precision.resolve_arg(args.trainer_dtype, args.device)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model)
    if args.quantization:
        return quantization_table(args, tokenizer)
    model = load_model(args.model, args.dtype, args.device)
    engines = {}
    for name in [e for e in args.engine if e.startswith("native")]:
        engines[name] = NativeEngine(load_model(args.model, args.dtype, args.device), tokenizer, num_slots=max(args.batch) * 512,
                                     max_batch_tokens=MAX_BATCH_TOKENS, decode_cache="off" if name == "native:gather" else "auto",
                                     prepack="off" if name == "native:plain" else "auto",
                                     cuda_graphs={"native:eager": "off", "native:graphs": "on"}.get(name, "auto"))
    if "sglang" in args.engine:
        engines["sglang"] = start_sglang(args.model, args.dtype, max(args.batch), tokenizer)
    print(f"machine: {machine()}\nmodel: {args.model} ({args.dtype}), {args.new_tokens} new tokens\n")
    for engine in engines.values():
        engine_generate(engine, gsm8k_prompts(tokenizer, 2), 4, True)  # warm-up
    packed_floor = args.device.type == "cpu" and args.dtype in ("float32", "fp32") and prepack_available()
    rows = []
    for mode in args.modes:
        for b in args.batch:
            prompts = gsm8k_prompts(tokenizer, b)
            ignore = mode == "fixed"
            runs = {"hf": lambda: hf_generate(model, tokenizer, prompts, args.new_tokens, ignore)}
            for engine in engines.values():
                if getattr(getattr(engine, "runner", None), "graphs", None) is not None:
                    engine_generate(engine, prompts, 8, ignore)  # captures this batch size's bucket
            for name, engine in engines.items():
                runs[name] = lambda engine=engine: engine_generate(engine, prompts, args.new_tokens, ignore)
                runs[name + ":1"] = lambda engine=engine: engine_generate(engine, prompts, 1, ignore)
            best = {}
            for _ in range(args.repeats):
                for name, fn in runs.items():  # one after another: no engine runs while another is timed
                    n, dt = fn()
                    best[name] = min(best.get(name, (float("inf"), 0)), (dt, n))
            prefill_s, step_s = floors(model, prompts, args.new_tokens, MAX_BATCH_TOKENS)
            packed_s = packed_matmul_floor(model, b) if packed_floor else float("nan")
            floor_s = prefill_s + (args.new_tokens - 1) * step_s
            hf_rate = best["hf"][1] / best["hf"][0]
            row = [mode, b, sum(map(len, prompts)), f"{b * args.new_tokens / floor_s:.1f}", f"{b / step_s:.1f}"]
            row += [f"{b / packed_s:.1f}"] if packed_floor else []
            row += [f"{hf_rate:.1f}"]
            for name in engines:
                (dt, n), (dt1, n1) = best[name], best[name + ":1"]
                rate = n / dt
                decode = (n - n1) / (dt - dt1) if ignore else float("nan")
                row += [f"{rate:.1f}", f"{rate * floor_s / (b * args.new_tokens):.0%}", f"{decode:.1f}",
                        f"{decode * step_s / b:.0%}"]
                row += [f"{decode * packed_s / b:.0%}"] if packed_floor else []
                row += [f"{rate / hf_rate:.2f}x"]
            rows.append(row)
            print(rows[-1], flush=True)
    print()
    headers = ["mode", "batch", "prompt tokens", "floor tok/s", "floor decode tok/s"]
    headers += ["packed floor decode tok/s"] if packed_floor else []
    headers += ["hf tok/s"]
    for name in engines:
        headers += [f"{name} tok/s", "of floor", f"{name} decode tok/s", "of decode floor"]
        headers += ["of packed decode floor"] if packed_floor else []
        headers += [f"{name} / hf"]
    print_table(headers, rows)
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()


if __name__ == "__main__":
    main()
