"""Seconds per training step and their split (rollout / old log-probs / update / weight sync), peak memory per
process, and the training throughput of packed vs padded micro-batches on one rollout.

    python benchmarks/train_step.py --nproc 2 --steps 3 [key=value overrides ...]
    python benchmarks/train_step.py --workload mawps --nproc 1 --steps 3 --trl --skip-packing
    python benchmarks/train_step.py --packing-only
    python benchmarks/train_step.py --update-floor
    python benchmarks/train_step.py --device cuda             # part 4 alone; --device cpu --dry-run: tiny, seconds

Part 1 runs `sparserl.trainer.grpo` under torchrun for `--steps` steps in a temporary folder (default preset
unless overridden) and prints every step's timings and memory: `mem/peak_gb` is rank 0's peak RSS so far (CPU)
or allocator peak (CUDA), `mem/peak_gb_max_rank` the largest over ranks, `mem/<phase>_peak_gb` the peak inside
each phase (what holds the peak), then the mean of each timing over the steps after the first (warm-up).
`--workload mawps` is the comparison workload: 16 MAWPS prompts x 4 samples, 128 new tokens, one optimizer step
per rollout, Dr.GRPO advantages, lr 1e-6, no KL, fp32 everywhere. With `--trl` the same workload also runs in
Hugging Face TRL's GRPOTrainer (benchmarks/trl_workload.py; TRL must be installed separately) and a table puts
the two side by side.
The means table includes `reward/mean`, `adv/zero_std_group_frac` and `actor/no_grad_seq_frac`: the share of
sequences whose group's rewards tie, which the actor runs without backward (`actor.skip_zero_advantage`; add
`actor.skip_zero_advantage=false` to time the update over every sequence, as TRL computes it).

Part 2 samples one rollout with the native engine (GSM8K questions, `--pack-n` samples each, up to
`--pack-new-tokens` tokens, stopping at EOS, so lengths are long-tailed as in RL) and times forward+backward of
a policy-gradient loss over all of its sequences, in one process, two ways on the same sequences and weights:
- packed (what the actor does): first-fit-decreasing micro-batches of at most `--max-tokens` real tokens,
  each one `(1, L)` row with per-sequence causal spans, LM head only on response rows;
- padded (the usual HF recipe): micro-batches of a fixed number of sequences in rollout order, right-padded
  to the longest one, `attention_mask`, full logits; the count is the most that fit `--max-tokens` at the
  rollout's longest sequence.
Tokens/s counts real tokens only (prompt + response), best of `--repeats`.

Part 3 (`--update-floor`, run alone) times forward+backward of one comparison-workload batch (the first 16 MAWPS
prompts with the workload's system prompt x 4 responses of 128 tokens) split and packed as the actor does it
(`actor.max_tokens_per_device` micro-batches, shared prompts, the chunked log-prob head, entropy as a metric),
with activation checkpointing on (the default) and off, against the matmul floor of the same micro-batches
(`benchmarks/common.py::train_matmul_floor`: each linear layer's forward, recomputed forward, dX and dW GEMMs at
the micro-batches' token counts, timed back to back in the same run). The optimizer step is not included.

Part 4 (`--device`, run alone): forward+backward of an 8k-token micro-batch on one device for a Qwen2.5-1.5B-shaped
model with random weights (no download), MFU against a GEMM peak measured in the same run, shared prompts and
activation checkpointing on/off, a 16k-token response under a 512-token prompt, and the ring block kernel against
one fused attention call; `--dry-run` runs it on a tiny config. benchmarks/train_step_device.py has the details.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import EVAL_DATA, gsm8k_prompts, machine, print_table, train_matmul_floor  # noqa: E402
from sparserl.utils import precision  # noqa: E402

KEYS = ["perf/step_s", "perf/rollout_s", "perf/old_logprobs_s", "perf/ref_logprobs_s", "perf/update_s", "perf/weight_sync_s",
        "perf/rollout_tok_s", "perf/train_tok_s", "perf/dp_load_imbalance_before", "perf/dp_load_imbalance",
        "response/len_mean", "reward/mean", "adv/zero_std_group_frac", "actor/no_grad_seq_frac", "mem/peak_gb",
        "mem/peak_gb_max_rank"]
PHASES = ["rollout", "old_logprobs", "ref_logprobs", "update", "weight_sync"]

MAWPS_SYSTEM = "Solve the problem and put your final answer within \\boxed{}."
WORKLOADS = {
    "mawps": ["data.train_path=" + str(EVAL_DATA / "mawps.jsonl"), "data.prompt_key=input",
              "data.answer_key=target", "env.path=envs/math.py",
              f"data.system_prompt='{MAWPS_SYSTEM}'",
              "rollout.n=4", "trainer.prompts_per_step=16", "rollout.max_new_tokens=128", "algo.adv_estimator=drgrpo",
              "actor.lr=1e-6", "model.compute_dtype=float32", "rollout.dtype=float32"],
}


def run_trainer(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "sparserl.trainer.grpo", f"trainer.total_steps={args.steps}", f"trainer.output_dir={tmp}/run",
               "trainer.export_hf=false", *WORKLOADS.get(args.workload, []), *args.overrides]
        env = {**os.environ, "SPARSERL_PROGRESS": "0"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"training failed:\n{res.stderr[-3000:]}")
        return [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]


def step_table(rows: list[dict]) -> None:
    phases = [p for p in PHASES if any(f"perf/{p}_s" in r for r in rows)]
    headers = ["step", "s/step", *[f"{p} s" for p in phases], "peak GB (rank 0)", "peak GB (max rank)",
               *[f"{p} peak GB" for p in phases], "RSS GB end"]
    print_table(headers, [[int(r["step"]), r["perf/step_s"], *[r.get(f"perf/{p}_s", 0.0) for p in phases], r["mem/peak_gb"],
                           r.get("mem/peak_gb_max_rank", r["mem/peak_gb"]), *[r.get(f"mem/{p}_peak_gb", 0.0) for p in phases],
                           r.get("mem/rss_gb", 0.0)] for r in rows], title="sparserl, every step")


def step_timings(args) -> list[dict]:
    rows = run_trainer(args)
    timed = rows[1:] or rows
    print(f"machine: {machine()}\nprocesses: {args.nproc}; workload: {args.workload or '(default preset)'}; "
          f"overrides: {' '.join(args.overrides) or '-'}\n")
    step_table(rows)
    print()
    print_table(["metric", "mean over steps 2.." + str(len(rows))],
                [[k, f"{sum(r.get(k, 0.0) for r in timed) / len(timed):.3f}"] for k in KEYS])
    return rows


def trl_steps(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        cmd = [sys.executable, str(Path(__file__).with_name("trl_workload.py")), str(out), "--steps", str(args.steps)]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        if res.returncode != 0:
            sys.exit(f"TRL run failed:\n{res.stderr[-3000:]}")
        return json.loads(out.read_text())["steps"]


def side_by_side(ours: list[dict], trl: list[dict]) -> None:
    def span(values):
        return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else f"{values[0]:.0f}"

    def peaks(values):
        return " -> ".join(f"{v:.2f}" for v in values)

    o, t = ours[1:] or ours, trl[1:] or trl
    rows = [["TRL GRPOTrainer", span([r["step_s"] for r in t]), span([r["rollout_s"] for r in t]), "-",
             span([r["step_s"] - r["rollout_s"] for r in t]), peaks([r["peak_gb"] for r in trl])],
            ["sparserl", span([r["perf/step_s"] for r in o]), span([r["perf/rollout_s"] for r in o]),
             span([r.get("perf/old_logprobs_s", 0.0) for r in o]) if any("perf/old_logprobs_s" in r for r in o) else "-",
             span([r["perf/update_s"] + r.get("perf/weight_sync_s", 0.0) for r in o]),
             peaks([r.get("mem/peak_gb_max_rank", r["mem/peak_gb"]) for r in ours])]]
    print_table(["system", "s/step (steps 2..)", "rollout s", "old log-probs s", "rest of step s", "peak memory GB per step"],
                rows, title="side by side, one run")
    ratio_t = (sum(r["step_s"] for r in t) / len(t)) / (sum(r["perf/step_s"] for r in o) / len(o))
    ratio_m = max(r["peak_gb"] for r in trl) / max(r.get("mem/peak_gb_max_rank", r["mem/peak_gb"]) for r in ours)
    print(f"\nTRL / sparserl: step time {ratio_t:.2f}x, peak memory {ratio_m:.2f}x")


def sample_rollout(model, tokenizer, args) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for every sampled sequence."""
    from sparserl.engines.native.engine import NativeEngine
    from sparserl.engines.types import GenerationRequest, SamplingParams

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
    from sparserl.model.attention import use_packed_attention

    tokenizer = load_tokenizer(args.model)
    dtype = precision.resolve_arg("auto")
    packed_model = load_model(args.model, dtype)
    use_packed_attention(packed_model)
    with torch.inference_mode():
        seqs = sample_rollout(packed_model, tokenizer, args)
    padded_model = load_model(args.model, dtype)  # stock attention (SDPA with a padding mask)
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


def workload_batch(tokenizer, prompts: int = 16, n: int = 4, new_tokens: int = 128) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) of one comparison-workload batch at its longest: every response
    `new_tokens` long (token values do not change the compute; a fixed generator picks them)."""
    rows = [json.loads(line) for line in open(EVAL_DATA / "mawps.jsonl")][:prompts]
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for r in rows:
        chat = [{"role": "system", "content": MAWPS_SYSTEM}, {"role": "user", "content": r["input"]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for _ in range(n):
            resp = torch.randint(100, len(tokenizer) - 100, (new_tokens,), generator=gen).tolist()
            seqs.append((prompt + resp, len(prompt)))
    return seqs


def update_floor(args) -> None:
    from sparserl.actor.hf import load_model, load_tokenizer
    from sparserl.actor.logprobs import PackedSeqs, _layout, chunk_mb_for, chunk_rows, packed_logprobs
    from sparserl.data.packing import split_microbatches

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, torch.float32)
    model.train()
    seqs = workload_batch(tokenizer)
    mbs = [PackedSeqs([seqs[i][0] for i in mb], [seqs[i][1] for i in mb])
           for mb in split_microbatches([len(s) for s, _ in seqs], args.max_tokens)]
    shapes = []
    for mb in mbs:
        flat, _, keep, _, _ = _layout(mb, True)
        shapes.append((len(flat), len(keep)))

    def fwd_bwd() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for mb in mbs:
            with contextlib.ExitStack() as hold:
                logp, _ = packed_logprobs(model, mb, torch.device("cpu"), with_entropy=True, entropy_grad=False,
                                          hold_context=hold)
                (-logp.sum() / len(seqs)).backward()
        return time.perf_counter() - t0

    rows = []
    for ac in (True, False):
        if ac:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        seconds = min(fwd_bwd() for _ in range(args.repeats + 1))  # the first pass warms up
        floor = train_matmul_floor(model, shapes, chunk_rows(model.get_output_embeddings().weight.shape[0],
                                                             chunk_mb_for(None, torch.device("cpu"))),
                                   recompute=ac, repeats=args.repeats)
        rows.append(["on" if ac else "off", len(mbs), sum(t for t, _ in shapes), f"{seconds:.2f}", f"{floor:.2f}",
                     f"{floor / seconds:.0%}"])
    print(f"machine: {machine()}\nbatch: {len(seqs)} sequences (16 MAWPS prompts x 4, 128 response tokens), "
          f"micro-batch bound {args.max_tokens} tokens, packed tokens per micro-batch {[t for t, _ in shapes]}; "
          f"{args.model} fp32, forward+backward, best of {args.repeats} after a warm-up pass\n")
    print_table(["activation ckpt", "micro-batches", "packed tokens", "fwd+bwd s", "matmul floor s", "of floor"], rows,
                title="update forward+backward against its matmul floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None)
    ap.add_argument("--trl", action="store_true", help="also run the workload in TRL's GRPOTrainer (needs trl installed)")
    ap.add_argument("--packing-only", action="store_true", help="skip part 1 (the trainer run)")
    ap.add_argument("--skip-packing", action="store_true", help="skip part 2 (packed vs padded)")
    ap.add_argument("--update-floor", action="store_true", help="run part 3 alone (forward+backward vs its matmul floor)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pack-prompts", type=int, default=16)
    ap.add_argument("--pack-n", type=int, default=4)
    ap.add_argument("--pack-new-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                    help="run part 4 alone on this device: forward+backward of a Qwen2.5-1.5B-shaped model")
    ap.add_argument("--dtype", default="bfloat16", help="part 4: the model's dtype")
    ap.add_argument("--dry-run", action="store_true", help="part 4 on a tiny config and short runs: the code path")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.device is not None:
        from benchmarks.train_step_device import device_update

        return device_update(args)
    if args.update_floor:
        return update_floor(args)
    if not args.packing_only:
        ours = step_timings(args)
        print()
        if args.trl:
            trl = trl_steps(args)
            print_table(["step", "s/step", "rollout s", "peak GB"], [[i + 1, r["step_s"], r["rollout_s"], r["peak_gb"]]
                                                                  for i, r in enumerate(trl)], title="TRL GRPOTrainer, every step")
            print()
            side_by_side(ours, trl)
            print()
    if not args.skip_packing:
        packing_throughput(args)


if __name__ == "__main__":
    main()
