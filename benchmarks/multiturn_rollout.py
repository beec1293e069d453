"""Multi-turn rollouts in the native engine: engine sessions (continue the held KV) vs re-prefilling the history.

    python benchmarks/multiturn_rollout.py --episodes 32 --turns 4 --new-tokens 128 --obs-tokens 32 --budget 128
    python benchmarks/multiturn_rollout.py --tiny     # a tiny random-init model: a quick check, no model files

A scripted env drives the engine directly: each episode starts from a GSM8K question in the chat template
(random token ids with `--tiny`); after every turn the env appends the same observation of ~`--obs-tokens`
tokens (a user turn and the next assistant header), for `--turns` turns. Every turn samples `--new-tokens`
tokens at temperature 1 ignoring EOS, with the same seed per (episode, turn) in every row, so both modes do
the same work. Modes:
- re-prefill: every turn sends the whole history as a new prompt (the env loop without sessions);
- session: `keep_session=True`, every turn continues the KV held since the last one and prefills only the
  last sampled token and the observation; `end_sessions()` after the rollout.
Rows: dense and R-KV (`--budget`), each mode. Columns: episodes/s over the whole rollout (all turns), tokens
prefilled, the most KV one sequence held in one turn (mean / max over turns of all episodes, MiB), the pool's
peak, sessions dropped under pool pressure (`--pool-slots` to impose some), and the share of turns whose
tokens equal the re-prefill row's (dense: expect all but fp rounding flips; R-KV: the two modes compress
different caches, so samples differ by design).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gsm8k_prompts, machine, print_table  # noqa: E402
from sparserl.kv import KVPolicyConfig  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.engines.types import GenerationRequest, SamplingParams  # noqa: E402
from sparserl.utils import precision  # noqa: E402

OBSERVATION = ("<|im_end|>\n<|im_start|>user\nThe tool returned: 42 apples, 17 oranges and 3 pears. Check the "
               "arithmetic so far and continue.<|im_end|>\n<|im_start|>assistant\n")


def tiny_model_and_inputs(episodes: int, obs_tokens: int, dtype: str):
    """A small random-init Llama (fast on CPU) with random prompts and a fixed random observation."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (int(torch.randint(40, 120, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(episodes)]
    obs = torch.randint(1, 512, (obs_tokens,), generator=gen).tolist()
    return model, None, prompts, obs


def real_model_and_inputs(path: str, episodes: int, obs_tokens: int, dtype: str):
    from sparserl.actor.hf import load_model, load_tokenizer

    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype)
    obs = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    # Pad (by repeating the observation's own text) or cut to the asked length, so the env's delta is fixed.
    while len(obs) < obs_tokens:
        obs = obs + obs
    return model, tokenizer, gsm8k_prompts(tokenizer, episodes), obs[:obs_tokens]


def rollout(engine: NativeEngine, prompts, obs, turns: int, new_tokens: int, sessions: bool):
    """One multi-turn rollout of every episode; returns per turn the generations, and the wall time."""
    history = [list(p) for p in prompts]
    out = []
    t0 = time.perf_counter()
    for t in range(turns):
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1000 + t)
        keep = sessions and t < turns - 1
        gens = engine.generate([GenerationRequest(h, params, i, session_id=i if sessions else None, keep_session=keep)
                                for i, h in enumerate(history)])
        out.append(gens)
        history = [h + g.token_ids + obs for h, g in zip(history, gens)]
    engine.end_sessions()  # a no-op here (the last turn keeps nothing); what a caller does after a rollout
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-init Llama instead of --model (quick check)")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the hardware runs it fast, else fp32")
    ap.add_argument("--episodes", type=int, default=None, help="default 32 (8 with --tiny)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None, help="per turn; default 128 (48 with --tiny)")
    ap.add_argument("--obs-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=128, help="R-KV budget (0: dense rows only)")
    ap.add_argument("--divide-length", type=int, default=None, help="default 128 (32 with --tiny)")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--pool-slots", type=int, default=0, help="0: room for every episode's full history densely")
    args = ap.parse_args()
    episodes = args.episodes or (8 if args.tiny else 32)
    new_tokens = args.new_tokens or (48 if args.tiny else 128)
    divide = args.divide_length or (32 if args.tiny else 128)
    dtype = precision.resolve_arg(args.dtype)
    if args.tiny:
        model, tokenizer, prompts, obs = tiny_model_and_inputs(episodes, args.obs_tokens, dtype)
        name = "tiny random Llama (4 layers, hidden 128)"
    else:
        model, tokenizer, prompts, obs = real_model_and_inputs(args.model, episodes, args.obs_tokens, dtype)
        name = args.model
    longest = max(len(p) for p in prompts) + args.turns * (new_tokens + len(obs))
    pool = args.pool_slots or episodes * longest
    print(f"machine: {machine()}\nmodel: {name} ({dtype}); {episodes} episodes x {args.turns} turns x {new_tokens} new "
          f"tokens, observation {len(obs)} tokens; prompts {min(len(p) for p in prompts)}-{max(len(p) for p in prompts)} "
          f"tokens; pool {pool} slots\n", flush=True)
    configs = [("dense", None)]
    if args.budget:
        configs.append((f"rkv b={args.budget}", KVPolicyConfig(algorithm="rkv", budget=args.budget, window=args.window,
                                                                divide_length=divide)))
    rows = []
    for name, kv in configs:
        reference = None
        for mode in ("re-prefill", "session"):
            engine = NativeEngine(model, tokenizer, num_slots=pool, kv=kv, seed=0)
            out, wall = rollout(engine, prompts, obs, args.turns, new_tokens, sessions=mode == "session")
            st = engine.stats()
            assert engine.pool.num_free == pool, "the rollout left slots held"
            peaks = [g.kv.peak_slots * st.kv_bytes_per_slot / 2**20 for gens in out for g in gens]
            if reference is None:
                reference, same = out, "-"
            else:
                pairs = [(a.token_ids, b.token_ids) for ga, gb in zip(out, reference) for a, b in zip(ga, gb)]
                same = f"{sum(a == b for a, b in pairs) / len(pairs):.0%}"
            rows.append([name, mode, f"{episodes / wall:.3f}", f"{wall:.1f}", st.prefill_tokens,
                         f"{sum(peaks) / len(peaks):.2f} / {max(peaks):.2f}", f"{st.peak_kv_bytes / 2**20:.1f}",
                         st.compressions, st.sessions_dropped, same])
            print(rows[-1], flush=True)
    print()
    print_table(["kv", "mode", "episodes/s", "wall s", "prefill tokens", "KV / seq / turn MiB (mean / max)",
                 "pool peak MiB", "compressions", "sessions dropped", "same tokens"], rows,
                title=f"{episodes} episodes x {args.turns} turns, {new_tokens} new + {len(obs)} observation tokens per turn")


if __name__ == "__main__":
    main()
