"""Peak memory of the actor's log-prob computation with full logits vs the chunked LM head.

    python benchmarks/logprob_memory.py [--tokens 8192] [--vocab 49152 151936] [--dtype bfloat16]

A random 2-layer decoder with SmolLM2-135M's width (hidden 576) and the given vocabulary (49,152 is SmolLM2's,
151,936 Qwen2.5's) computes the log-probs of `--tokens` response tokens (8 sequences, 16-token prompts) with
`packed_logprobs`, twice per setting: without autograd (the old/reference log-prob pass) and forward + backward of
a loss on them (the update). `chunk 0` materializes the (tokens x vocabulary) logits at once (as before the
chunked head); the default chunk bounds one fp32 logit buffer to 64 MB. Each measurement runs in a fresh
process; the number is the peak minus the memory in use just before (resident set on CPU, allocator on CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402


def one(args) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs
    from sparserl.utils.memory import PhasePeaks, release_free_memory

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=getattr(torch, args.dtype))
    n_seq, prompt = 8, 16
    resp = args.tokens // n_seq
    g = torch.Generator().manual_seed(0)
    seqs = PackedSeqs([torch.randint(0, args.vocab, (prompt + resp,), generator=g).tolist() for _ in range(n_seq)], [prompt] * n_seq)
    peaks = PhasePeaks(device, interval_s=0.01)
    release_free_memory()
    base = peaks.current()
    peaks.start()
    if args.grad:
        logp, _ = packed_logprobs(model, seqs, device, chunk_mb=args.chunk_mb)
        (-logp.sum()).backward()
    else:
        with torch.no_grad():
            packed_logprobs(model, seqs, device, chunk_mb=args.chunk_mb)
    print(json.dumps({"extra_gb": peaks.stop() - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunks", type=float, nargs="+", default=[0, 64])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--chunk-mb", type=float, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.vocab = args.vocab[0]
        return one(args)
    rows = []
    for vocab in args.vocab:
        for chunk in args.chunks:
            row = [vocab, "full logits" if chunk == 0 else f"chunked, {chunk:g} MB"]
            for grad in (False, True):
                cmd = [sys.executable, __file__, "--one", "--tokens", str(args.tokens), "--vocab", str(vocab), "--dtype", args.dtype,
                       "--chunk-mb", str(chunk)] + (["--grad"] if grad else [])
                res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if res.returncode != 0:
                    row.append(f"failed (exit {res.returncode}{', out of memory' if res.returncode in (-9, 137) else ''})")
                else:
                    row.append(f"{json.loads(res.stdout.strip().splitlines()[-1])['extra_gb']:.2f}")
            rows.append(row)
            print_table(["vocabulary", "LM head", "no-grad peak GB", "fwd+bwd peak GB"], rows[-1:])
    print(f"\nmachine: {machine()}; {args.tokens} response tokens, {args.dtype}, hidden 576, 2 layers\n")
    print_table(["vocabulary", "LM head", "log-probs without autograd: peak GB", "forward + backward: peak GB"], rows,
                title="extra memory of the log-prob computation")


if __name__ == "__main__":
    main()
