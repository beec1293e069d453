"""`rollout.prepack` side by side: the native engine's decode step with the linear weights packed for the decode
batch (oneDNN's and MKL's packed float32 GEMMs, engines/native/prepack.py) and with plain GEMMs, in turns, plus the
same decode step's GEMMs alone each way (the floors).

    python benchmarks/prepack.py                       # batch 8 and 64, SmolLM2-135M-Instruct, fp32
    python benchmarks/prepack.py --batch 4 8 16 32 64 --rounds 6

One engine per kernel and one with plain GEMMs, on the same model and prompts (GSM8K questions), temperature 1, EOS ignored. A decode step's time is
(a run of `--new-tokens` tokens minus a run of 1 token) / (new_tokens - 1), so the prefill cancels; the engines
take turns, `--rounds` runs each, and the table gives the fastest and the median of each side and their ratios to the plain
engine (a shared machine moves single runs by 10-20%; turns keep the drift on every side). `gemms ms` is the decode
step's linear layers and LM head at M = the batch, back to back (benchmarks/common.py: `matmul_floor` and
`packed_matmul_floor`). `auto` names the kernel `rollout.prepack=auto` picks on this CPU. float32 on CPU only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gsm8k_prompts, machine, matmul_floor, packed_matmul_floor, print_table  # noqa: E402
from sparserl.actor.hf import load_model, load_tokenizer  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.native.prepack import available_kernels, default_kernel  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402


def run_seconds(engine: NativeEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    kernels = available_kernels()
    if not kernels:
        raise SystemExit("this torch has no packed float32 GEMM (oneDNN's or MKL's): nothing to compare")
    tokenizer = load_tokenizer(args.model)
    settings = ["off"] + kernels
    engines = {setting: NativeEngine(load_model(args.model, "float32", "cpu"), tokenizer, num_slots=max(args.batch) * 512,
                                     prepack=setting) for setting in settings}
    print(f"machine: {machine()}\nmodel: {args.model} (float32), {args.new_tokens} new tokens, {args.rounds} rounds; "
          f"rollout.prepack=auto packs for {default_kernel()} here\n")
    rows = []
    for b in args.batch:
        prompts = gsm8k_prompts(tokenizer, b)
        steps: dict[str, list[float]] = {k: [] for k in engines}
        for engine in engines.values():
            run_seconds(engine, prompts, 2)  # warm-up (and the first packing)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                full, one = run_seconds(engine, prompts, args.new_tokens), run_seconds(engine, prompts, 1)
                steps[name].append((full - one) / (args.new_tokens - 1) * 1e3)
        model = engines["off"].runner.model
        gemm_ms = {"off": matmul_floor(model, [b], [b]) * 1e3}
        gemm_ms.update({k: packed_matmul_floor(model, b, kernel=k) * 1e3 for k in kernels})
        off = steps["off"]
        for name in settings:
            ms = steps[name]
            rows.append([b, name, f"{min(ms):.1f} / {statistics.median(ms):.1f}", f"{min(off) / min(ms):.2f}x",
                         f"{statistics.median(off) / statistics.median(ms):.2f}x", f"{gemm_ms[name]:.1f}",
                         f"{gemm_ms['off'] / gemm_ms[name]:.2f}x"])
            print(rows[-1], flush=True)
    print()
    print_table(["batch", "rollout.prepack", "decode step ms (min / median)", "off / this (min)", "off / this (median)",
                 "gemms ms", "gemms off / this"], rows)


if __name__ == "__main__":
    main()
