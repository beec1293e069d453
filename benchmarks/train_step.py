"""Seconds per training step and their split (rollout / old log-probs / update / weight sync), and the
training throughput of packed vs padded micro-batches on one rollout.

    python benchmarks/train_step.py --nproc 2 --steps 3 [key=value overrides ...]
    python benchmarks/train_step.py --packing-only

Part 1 runs `sparserl.trainer.grpo` under torchrun for `--steps` steps in a temporary folder (default preset
unless overridden) and prints the mean of each timing over the steps after the first (the first includes
warm-up).

Part 2 samples one rollout with the native engine (GSM8K questions, `--pack-n` samples each, up to
`--pack-new-tokens` tokens, stopping at EOS, so lengths are long-tailed as in RL) and times forward+backward of
a policy-gradient loss over all of its sequences, in one process, two ways on the same sequences and weights:
- packed (what the actor does): first-fit-decreasing micro-batches of at most `--max-tokens` real tokens,
  each one `(1, L)` row with per-sequence causal spans, LM head only on response rows;
- padded (the usual HF recipe): micro-batches of a fixed number of sequences in rollout order, right-padded
  to the longest one, `attention_mask`, full logits; the count is the most that fit `--max-tokens` at the
  rollout's longest sequence.
Tokens/s counts real tokens only (prompt + response), best of `--repeats`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gsm8k_prompts, machine, print_table  # noqa: E402

KEYS = ["perf/step_s", "perf/rollout_s", "perf/old_logprobs_s", "perf/update_s", "perf/weight_sync_s",
        "perf/rollout_tok_s", "perf/train_tok_s", "perf/dp_load_imbalance_before", "perf/dp_load_imbalance",
        "response/len_mean", "mem/peak_gb"]


def step_timings(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "sparserl.trainer.grpo", f"trainer.total_steps={args.steps}", f"trainer.output_dir={tmp}/run",
               "trainer.export_hf=false", *args.overrides]
        env = {**os.environ, "SPARSERL_PROGRESS": "0"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"training failed:\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    timed = rows[1:] or rows
    print(f"machine: {machine()}\nprocesses: {args.nproc}; overrides: {' '.join(args.overrides) or '(default preset)'}\n")
    print_table(["metric", "mean over steps 2.." + str(len(rows))],
                [[k, f"{sum(r.get(k, 0.0) for r in timed) / len(timed):.3f}"] for k in KEYS])


def sample_rollout(model, tokenizer, args) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for every sampled sequence."""
    from sparserl.rollout.native.engine import NativeEngine
    from sparserl.rollout.types import GenerationRequest, SamplingParams

    prompts = gsm8k_prompts(tokenizer, args.pack_prompts)
    slots = len(prompts) * args.pack_n * (max(map(len, prompts)) + args.pack_new_tokens)
    engine = NativeEngine(model, tokenizer, num_slots=slots, max_num_seqs=256, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.pack_new_tokens, n=args.pack_n, seed=0)
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    return [(g.prompt_token_ids + g.token_ids, len(g.prompt_token_ids)) for g in gens if g.token_ids]


def packed_pass(model, seqs, max_tokens) -> tuple[int, int]:
    """Returns (micro-batches, token positions computed)."""
    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs
    from sparserl.data.packing import split_microbatches

    mbs = split_microbatches([len(s) for s, _ in seqs], max_tokens)
    for mb in mbs:
        logp, _ = packed_logprobs(model, PackedSeqs([seqs[i][0] for i in mb], [seqs[i][1] for i in mb]), torch.device("cpu"))
        (-logp.sum() / len(seqs)).backward()
    return len(mbs), sum(len(s) for s, _ in seqs)


def padded_pass(model, seqs, per_mb) -> tuple[int, int]:
    """Returns (micro-batches, token positions computed, padding included)."""
    count = computed = 0
    for start in range(0, len(seqs), per_mb):
        chunk = seqs[start : start + per_mb]
        L = max(len(s) for s, _ in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        attn = torch.zeros(len(chunk), L, dtype=torch.long)
        resp = torch.zeros(len(chunk), L - 1)
        for i, (s, p) in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            resp[i, p - 1 : len(s) - 1] = 1.0  # row t predicts token t + 1
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(logp * resp).sum() / len(seqs)).backward()
        count, computed = count + 1, computed + ids.numel()
    return count, computed


def packing_throughput(args) -> None:
    from sparserl.actor.hf import load_model, load_tokenizer
    from sparserl.rollout.native.attention import use_packed_attention

    tokenizer = load_tokenizer(args.model)
    packed_model = load_model(args.model, "bfloat16")
    use_packed_attention(packed_model)
    with torch.inference_mode():
        seqs = sample_rollout(packed_model, tokenizer, args)
    padded_model = load_model(args.model, "bfloat16")  # stock attention (SDPA with a padding mask)
    lengths = sorted(len(s) for s, _ in seqs)
    real = sum(lengths)
    per_mb = max(1, args.max_tokens // lengths[-1])
    times, shape = {}, {}
    for name, model, fn, arg in [("packed", packed_model, packed_pass, args.max_tokens), ("padded", padded_model, padded_pass, per_mb)]:
        best = None
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            shape[name] = fn(model, seqs, arg)
            best = min(best or 1e9, time.perf_counter() - t0)
        times[name] = best
    print(f"machine: {machine()}\nrollout: {len(seqs)} sequences ({args.pack_prompts} GSM8K prompts x {args.pack_n}), "
          f"lengths {lengths[0]}-{lengths[-1]} (median {lengths[len(lengths) // 2]}), {real} tokens; "
          f"micro-batch bound {args.max_tokens} tokens; {args.model} bf16, forward+backward\n")
    rows = [[name, *shape[name], f"{times[name]:.1f}", f"{real / times[name]:.0f}", f"{times['packed'] / times[name]:.2f}x"]
            for name in ("packed", "padded")]
    print_table(["micro-batches", "count", "tokens computed", "seconds", "real tokens/s", "vs packed"], rows,
                title="packed vs padded, same rollout")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--packing-only", action="store_true", help="skip part 1 (the trainer run)")
    ap.add_argument("--skip-packing", action="store_true", help="skip part 2 (packed vs padded)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pack-prompts", type=int, default=16)
    ap.add_argument("--pack-n", type=int, default=4)
    ap.add_argument("--pack-new-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not args.packing_only:
        step_timings(args)
        print()
    if not args.skip_packing:
        packing_throughput(args)


if __name__ == "__main__":
    main()
