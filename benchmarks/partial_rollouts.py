"""Partial rollouts against synchronous ones on the long-tail env (envs/long_tail.py): step time, rollout time per step
and rollout idle share, at equal samples per step.

    python benchmarks/partial_rollouts.py            # the docs/training.md table (a few minutes on 2 CPU cores)
    python benchmarks/partial_rollouts.py --quick    # a smaller run for CI

Both modes run the trainer's rollout call for partial rollouts (sparserl/rollout/partial.py) on the native engine
with a random-init Llama built from a config and a byte-level tokenizer; "synchronous" is `max_staleness=0`, which
carries nothing (the synchronous loop's requests). Each step opens the same `--prompts` new prompts x `--n` samples;
then the actor (sparserl's `Actor` on the same model, one process) computes logp_old and takes one GRPO optimizer
step on the step's trained samples (group-normalized env rewards, the PPO-clip loss), and its weights are pushed into
the engine (`update_weights` of `full_state()`), so a carried sample re-prefills under new weights as in training and
the step time is rollout + update + weight sync. `--no-update` moves the weights by a small random step instead and
times the rollout alone. A random model cannot learn when to stop, so each response is capped at
its row's target length (`--tokens-per-number` tokens per number of the count, EOS ignored): the lengths are the
env's heavy-tailed ones. Idle share: the share of the engine's forward time spent with fewer than half of a step's
samples (`--prompts` x `--n`) in the forward. The first `--warmup` steps (the pipeline filling) are not counted.

Left out on purpose: a trained model (its lengths would be its own, not the env's), and several processes.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from sparserl.data.dataset import PromptRow
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import SamplingParams
from sparserl.rollout.partial import PartialRollouts, PartialSettings
from sparserl.utils.envload import load_env

ROOT = Path(__file__).resolve().parents[1]


ENV = load_env(str(ROOT / "envs" / "long_tail.py")).module


def byte_tokenizer(folder: Path):
    """One token per byte, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(folder)
    return tok


def tiny_llama(vocab: int, hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg).eval()


class CappedRollouts(PartialRollouts):
    """Each group's responses capped at its row's target length (a stand-in for a policy that writes it)."""

    per_number: int = 2

    def _budget(self, group) -> int:
        return min(super()._budget(group), group.members[0].sample.extra_info["target_len"] * self.per_number)


def timed_engine(model, tok, busy: int, log: list) -> NativeEngine:
    """The native engine with each forward step's (seconds, sequences in it) recorded in `log`."""
    engine = NativeEngine(model, tok, num_slots=1 << 16, eos_token_ids=[])
    step = engine._step

    def recorded(batch, *rest):
        t0 = time.perf_counter()
        step(batch, *rest)
        log.append((time.perf_counter() - t0, len(batch)))

    engine._step = recorded
    return engine


class Learner:
    """The actor's side of a step: logp_old, one GRPO optimizer step, the weights back into the engine."""

    def __init__(self, model, tok, n: int) -> None:
        from sparserl.actor.actor import Actor
        from sparserl.algo.loss import LossConfig
        from sparserl.parallel import ParallelDims, init_distributed
        from sparserl.trainer.loss import make_loss_fn

        folder = Path(tempfile.mkdtemp())
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        info = init_distributed("cpu")
        mesh = ParallelDims.from_world(info.world_size, 1).build_mesh("cpu")
        self.actor = Actor(str(folder), mesh, info.device, dtype="float32", compute_dtype="float32", lr=1e-5,
                           max_tokens_per_device=8192, activation_checkpointing=False)
        self.loss_fn, self.n = make_loss_fn(LossConfig()), n

    def step(self, samples) -> None:
        from sparserl.trainer.train_batch import to_train_batch

        batch = to_train_batch(samples, "cpu")
        rewards = torch.tensor([s.reward for s in samples]).view(-1, self.n)
        batch.advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        batch.logp_old = self.actor.logprobs(batch)
        self.actor.update(batch, self.loss_fn)

    def weights(self):
        return self.actor.full_state()


def run_mode(name: str, settings: PartialSettings, args, model, tok) -> dict:
    log: list[tuple[float, int]] = []
    busy = args.prompts * args.n
    learner = None if args.no_update else Learner(model, tok, args.n)
    engine = timed_engine(model, tok, busy, log)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n, ignore_eos=True)
    loop = CappedRollouts(engine, tok, ENV, params, settings, show_progress=False)
    loop.per_number = args.tokens_per_number
    rows = ENV.make_prompts(args.prompts * args.steps, seed=args.seed)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    step_s, rollout_s, trained, forward = [], [], [], []
    for step in range(1, args.steps + 1):
        batch = rows[(step - 1) * args.prompts: step * args.prompts]
        prompt_rows = [PromptRow(r["prompt"][0]["content"], r["answer"], {"target_len": r["target_len"]},
                                 (step - 1) * args.prompts + i) for i, r in enumerate(batch)]
        texts = [r["prompt"][0]["content"] for r in batch]
        del log[:]
        t0 = time.perf_counter()
        samples, _ = loop.at(step, 1000 + step)(prompt_rows, texts, [r.index for r in prompt_rows], name)
        rolled = time.perf_counter() - t0
        if learner is not None:
            learner.step(samples)
            engine.update_weights(learner.weights())
        else:
            torch.manual_seed(step)  # the update between steps: the same small random move in both modes
            engine.update_weights((k, v + 1e-3 * torch.randn_like(v)) for k, v in start.items())
        if step > args.warmup:
            step_s.append(time.perf_counter() - t0)
            rollout_s.append(rolled)
            trained.append(len(samples))
            forward += log
    total = sum(t for t, _ in forward)
    idle = sum(t for t, running in forward if running < busy / 2)
    return {"mode": name, "step_s": sum(step_s) / len(step_s), "rollout_s": sum(rollout_s) / len(rollout_s),
            "idle_frac": idle / max(total, 1e-9),
            "trained_per_step": sum(trained) / len(trained), "in_flight_at_end": loop.in_flight,
            "new_tokens": engine.stats().new_tokens}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run for CI")
    ap.add_argument("--prompts", type=int, default=8, help="new prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps not counted (the pipeline filling)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tokens-per-number", type=int, default=2)
    ap.add_argument("--finish-frac", type=float, default=0.5)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-update", action="store_true", help="no actor update: a random weight move between steps")
    ap.add_argument("--out", type=Path, default=None, help="write table.md and results.json here")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.steps, args.warmup, args.hidden, args.layers = 4, 2, 4, 1, 64, 2
        args.tokens_per_number, args.max_new_tokens = 1, 96
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = byte_tokenizer(Path(tempfile.mkdtemp()))
    model = tiny_llama(len(tok), args.hidden, args.layers)
    rows = [run_mode("synchronous", PartialSettings(max_staleness=0), args, model, tok)]
    model = tiny_llama(len(tok), args.hidden, args.layers)  # the same start for the second mode
    rows.append(run_mode("partial", PartialSettings(args.finish_frac, 0, args.max_staleness), args, model, tok))
    speedup = rows[0]["step_s"] / rows[1]["step_s"]
    rollout_speedup = rows[0]["rollout_s"] / rows[1]["rollout_s"]
    lines = ["| mode | step s | rollout s / step | idle share | samples trained / step | in flight at end |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['idle_frac']:.1%} | "
              f"{r['trained_per_step']:.1f} | {r['in_flight_at_end']} |" for r in rows]
    what = "rollout only, no update" if args.no_update else "rollout + update + weight sync"
    lines.append(f"\nsynchronous / partial step time ({what}): {speedup:.2f}x; rollout time: {rollout_speedup:.2f}x")
    table = "\n".join(lines)
    print(table)
    result = {"rows": rows, "speedup": speedup, "rollout_speedup": rollout_speedup, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
