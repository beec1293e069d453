"""The rollout side of the GPU check (scripts/gpu_check.sh): the native engine's decode step on a
Qwen2.5-1.5B-shaped model with random weights, built on the device from a config written here (no download).

    python benchmarks/gpu_decode.py --device cuda                 # the GPU table
    python benchmarks/gpu_decode.py --device cpu --dry-run        # the same code on a tiny config, in seconds

Tables (each engine built with `rollout.cuda_graphs` off = eager, on = static buffers captured as CUDA graphs), every
row printed as soon as it is measured:
1. Decode step: milliseconds per decode step (generate of N new tokens minus generate of 1, over N - 1 steps), host
   launches per step (kernel and graph launches seen by the profiler, the same difference), synchronizing calls
   per step (CUDA's sync detector in `warn` mode, the same difference) and event waits per step. The detector does
   not see an event wait (`cudaEventSynchronize`), so a captured step shows 0 syncs: its one wait, after the
   sampled tokens' copy, is counted by the step itself (`StaticDecode.waits`). Also the graph captures and the
   seconds they took (`rollout/graph_capture_s`).
2. Throughput: new tokens/s of the eager and captured engines and of transformers' `generate` (static batch) on the
   same prompts, against the step's floor: the decode GEMMs at M = batch (`benchmarks/common.py::matmul_floor`) plus
   one read of the batch's KV at its mean length, both timed in this run.
3. KV compression: R-KV (budget 512) against dense at one fixed pool, graphs on: requests that wait for pool room
   run in later waves, so what compression saves turns into throughput.
4. Weight sync: seconds to push every weight into the sleeping engine (`update_weights`), and graph captures.

Sampling is at temperature 1 with EOS ignored: every sequence makes exactly the tokens asked for. Random weights give
valid speeds only (rewards and accuracies would mean nothing).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, matmul_floor, sync  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402
from sparserl.kv import KVPolicyConfig  # noqa: E402

# Qwen2.5-1.5B's shape (its config.json): what the GPU numbers are quoted for.
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)


def build_model(dry_run: bool, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**(TINY if dry_run else QWEN25_15B))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def run(engine: NativeEngine, ps: list[list[int]], new_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    sync(engine.runner.device)
    t0 = time.perf_counter()
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(ps)])
    sync(engine.runner.device)
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


class Table:
    """A markdown table printed a row at a time, as the rows are measured (a stage cut short keeps what it printed)."""

    def __init__(self, headers: list[str], title: str, note: str | None = None) -> None:
        print(f"\n**{title}**\n", flush=True)
        if note:
            print(note + "\n", flush=True)
        print("| " + " | ".join(headers) + " |", flush=True)
        print("|" + "|".join("---" for _ in headers) + "|", flush=True)

    def row(self, cells: list) -> None:
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def launches_syncs_waits(engine: NativeEngine, ps: list[list[int]], new_tokens: int) -> tuple[int, int, int] | None:
    """(host launches, synchronizing calls, event waits) of one generate of `new_tokens`; None on CPU."""
    if engine.runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(engine, ps, new_tokens)
    launches = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key or "GraphLaunch" in e.key)
    graphs = engine.runner.graphs
    waits = graphs.waits if graphs is not None else 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(engine, ps, new_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    return launches, syncs, (graphs.waits - waits if graphs is not None else 0)


def step_tables(model, args, batches: list[int], new: int) -> None:
    """Tables 1 and 2, for both engine modes at each batch."""
    vocab, plen = model.config.vocab_size, args.prompt_len
    kv_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * model.dtype.itemsize
    steps = Table(["batch", "engine", "ms / decode step", "launches / step", "syncs / step (detector)",
                   "event waits / step", "graph captures", "capture s"],
                  f"Decode step ({new} new tokens after {plen}-token prompts)",
                  "syncs: CUDA's sync detector, which does not see an event wait; event waits: counted by the "
                  "static step (its one wait per step, after the sampled tokens' copy)")
    rates = []
    for b in batches:
        ps = prompts(b, plen, vocab)
        rate = [b]
        for mode in ("off", "on"):
            engine = NativeEngine(model, None, num_slots=b * (plen + new) + 64, max_num_seqs=b, cuda_graphs=mode,
                                  seed=0, eos_token_ids=[])
            run(engine, ps, 4)  # warm-up (and the captures)
            _, t1 = run(engine, ps, 1)
            n, tn = run(engine, ps, new)
            step_ms = 1000 * max(tn - t1, 1e-9) / (new - 1)
            one, nine = launches_syncs_waits(engine, ps, 1), launches_syncs_waits(engine, ps, 9)
            per = ["n/a"] * 3 if one is None else [f"{(c - a) / 8:.1f}" for a, c in zip(one, nine)]
            extra = engine.stats().extra
            steps.row([b, "captured" if mode == "on" else "eager", f"{step_ms:.2f}", *per,
                       int(extra.get("rollout/graph_captures", 0)), f"{extra.get('rollout/graph_capture_s', 0.0):.2f}"])
            rate.append(f"{n / tn:.0f}")
            engine.sleep()  # the pool goes; the model (shared by every engine here) keeps its weights
        rates.append(rate)
    table = Table(["batch", "eager tok/s", "captured tok/s", "HF generate tok/s", "floor tok/s", "floor ms / step"],
                  "Decode throughput against transformers and the step's floor (GEMMs + one KV read)")
    for b, rate in zip(batches, rates):  # the engines' rates from above; transformers and the floor measured now
        hf = hf_generate(model, prompts(b, plen, vocab), new)
        floor_s = matmul_floor(model, [b], [b], repeats=3) + kv_read_seconds(b * (plen + new / 2) * kv_bytes, model.device)
        table.row(rate + [f"{hf:.0f}", f"{b / floor_s:.0f}", f"{1000 * floor_s:.2f}"])


def kv_read_seconds(nbytes: float, device: torch.device) -> float:
    """One read of `nbytes` of KV: a sum over a tensor that size, best of 3, timed here."""
    x = torch.ones(max(int(nbytes) // 2, 1), dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def hf_generate(model, ps: list[list[int]], new: int) -> float:
    ids = torch.tensor(ps, device=model.device)
    sync(model.device)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    sync(model.device)
    return ids.shape[0] * new / (time.perf_counter() - t0)


def kv_table(model, args) -> None:
    """Table 3: dense vs R-KV budget `args.kv_budget` at one pool sized for `args.dense_fit` dense sequences."""
    new, plen, n = args.kv_new_tokens, args.kv_prompt_len, args.kv_requests
    pool = args.dense_fit * (plen + new)
    ps = prompts(n, plen, model.config.vocab_size, seed=1)
    table = Table(["KV", "requests", "pool slots", "peak running", "tok/s", "vs dense", "graph captures", "capture s"],
                  f"KV compression at a fixed pool ({new} new tokens after {plen}-token prompts, graphs on)")
    dense_rate = None
    for name, kv in (("dense", None), (f"rkv {args.kv_budget}",
                                        KVPolicyConfig(algorithm="rkv", budget=args.kv_budget, divide_length=args.kv_divide))):
        engine = NativeEngine(model, None, num_slots=pool, max_num_seqs=n, kv=kv, cuda_graphs="on", seed=0,
                              eos_token_ids=[])
        run(engine, ps[:2], 4)
        toks, dt = run(engine, ps, new)
        st = engine.stats()
        rate = toks / dt
        dense_rate = dense_rate or rate
        table.row([name, n, pool, st.peak_running, f"{rate:.0f}", f"{rate / dense_rate:.2f}",
                   int(st.extra.get("rollout/graph_captures", 0)), f"{st.extra.get('rollout/graph_capture_s', 0.0):.2f}"])
        engine.sleep()


def sync_table(model) -> None:
    """Table 4: a full weight push into a sleeping engine that released its weights, then a generate."""
    engine = NativeEngine(model, None, num_slots=4096, max_num_seqs=8, cuda_graphs="on", release_weights=True,
                          seed=0, eos_token_ids=[])
    ps = prompts(8, 32, model.config.vocab_size)
    run(engine, ps, 4)
    source = {k: v.detach().clone() for k, v in engine.runner.model.state_dict().items()}
    engine.sleep()
    sync(model.device)
    t0 = time.perf_counter()
    engine.update_weights(source.items())
    sync(model.device)
    push_s = time.perf_counter() - t0
    engine.wake()
    run(engine, ps, 4)
    extra = engine.stats().extra
    table = Table(["weights MB", "push s", "graph captures (two generates)", "capture s"], "Weight sync")
    table.row([f"{sum(v.numel() * v.element_size() for v in source.values()) / 2**20:.0f}", f"{push_s:.3f}",
               int(extra.get("rollout/graph_captures", 0)), f"{extra.get('rollout/graph_capture_s', 0.0):.2f}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dry-run", action="store_true", help="a tiny config and short runs: the code path, in seconds")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--kv-budget", type=int, default=512)
    ap.add_argument("--kv-new-tokens", type=int, default=2048)
    ap.add_argument("--kv-prompt-len", type=int, default=64)
    ap.add_argument("--kv-requests", type=int, default=24)
    ap.add_argument("--kv-divide", type=int, default=128, help="R-KV compresses every this many steps once over budget")
    ap.add_argument("--dense-fit", type=int, default=8, help="the fixed pool holds this many dense sequences")
    ap.add_argument("--tables", nargs="+", default=["step", "kv", "sync"], choices=["step", "kv", "sync"])
    args = ap.parse_args()
    if args.dry_run:
        args.batch, args.new_tokens, args.prompt_len = [4, 8], 12, 16
        args.kv_budget, args.kv_new_tokens, args.kv_prompt_len, args.kv_requests, args.dense_fit = 16, 48, 8, 6, 2
        args.kv_divide = 8
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args.dry_run, device, getattr(torch, args.dtype))
    print(f"machine: {machine()} | device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} | "
          f"{'tiny' if args.dry_run else 'Qwen2.5-1.5B'}-shaped, random weights, {args.dtype}")
    if "step" in args.tables:
        step_tables(model, args, args.batch, args.new_tokens)
    if "kv" in args.tables:
        kv_table(model, args)
    if "sync" in args.tables:
        sync_table(model)


if __name__ == "__main__":
    main()
