"""`rollout.prepack` side by side: the native engine's decode step with the linear weights packed for the decode
batch (MKL's packed float32 GEMM, engines/native/prepack.py) and with plain GEMMs, in turns, plus the same
decode step's GEMMs alone both ways (the floors).

    python benchmarks/prepack.py                       # batch 8 and 64, SmolLM2-135M-Instruct, fp32
    python benchmarks/prepack.py --batch 4 8 16 32 64 --rounds 6

Two engines on the same model and prompts (GSM8K questions), temperature 1, EOS ignored. A decode step's time is
(a run of `--new-tokens` tokens minus a run of 1 token) / (new_tokens - 1), so the prefill cancels; the engines
take turns, `--rounds` runs each, and the table gives the fastest and the median of each side and their ratios (a
shared machine moves single runs by 10-20%; turns keep the drift on both sides). `gemms plain / packed ms` is the
decode step's linear layers and LM head at M = the batch, back to back (benchmarks/common.py: `matmul_floor` and
`packed_matmul_floor`). float32 on CPU only: packing is an MKL float32 kernel.
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
from sparserl.engines.native.prepack import prepack_available  # noqa: E402
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
    if not prepack_available():
        raise SystemExit("this torch has no MKL packed GEMM (torch.ops.mkl._mkl_linear): nothing to compare")
    tokenizer = load_tokenizer(args.model)
    engines = {setting: NativeEngine(load_model(args.model, "float32", "cpu"), tokenizer, num_slots=max(args.batch) * 512,
                                     prepack=setting) for setting in ("on", "off")}
    print(f"machine: {machine()}\nmodel: {args.model} (float32), {args.new_tokens} new tokens, {args.rounds} rounds\n")
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
        on, off = steps["on"], steps["off"]
        model = engines["off"].runner.model
        plain_ms, packed_ms = matmul_floor(model, [b], [b]) * 1e3, packed_matmul_floor(model, b) * 1e3
        rows.append([b, f"{min(on):.1f} / {statistics.median(on):.1f}", f"{min(off):.1f} / {statistics.median(off):.1f}",
                     f"{min(off) / min(on):.2f}x", f"{statistics.median(off) / statistics.median(on):.2f}x",
                     f"{plain_ms:.1f} / {packed_ms:.1f}", f"{plain_ms / packed_ms:.2f}x"])
        print(rows[-1], flush=True)
    print()
    print_table(["batch", "decode step ms, prepack on (min / median)", "prepack off (min / median)", "off / on (min)",
                 "off / on (median)", "gemms plain / packed ms", "gemms plain / packed"], rows)


if __name__ == "__main__":
    main()
