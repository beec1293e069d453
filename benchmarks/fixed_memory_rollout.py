"""The rollout half of `benchmarks/fixed_memory.py`: one row's engine built as the trainer builds it, one timed
generate, the columns it gives; and the models it runs (a tiny random Llama for --quick, random weights at a shape
for --gpu)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.fixed_memory_rows import Row

# ----------------------------------------------------------------------------- the rollout half


@dataclass
class Prompts:
    ids: list[list[int]]
    answers: list[str | None]


def task_prompts(cfg, tokenizer, data: Path, num: int) -> tuple[Prompts, int]:
    """The first `num` rows of the data file as the trainer formats them, and the longest prompt of the whole file
    (what the trainer sizes its pool by)."""
    from sparserl.data.dataset import PromptRow, format_prompt
    from sparserl.rollout.episode import encode_text

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    ids = [encode_text(tokenizer, format_prompt(PromptRow(r["prompt"], r.get("answer"), index=i), tokenizer,
                                                cfg.data.apply_chat_template, cfg.data.system_prompt))
           for i, r in enumerate(rows)]
    return Prompts(ids[:num], [r.get("answer") for r in rows[:num]]), max(map(len, ids))


def build_engine(cfg, model_path: str, tokenizer, device, longest: int, model=None):
    """The engine a run of `cfg` builds, at the pool `rollout.kv_memory` gives (the trainer's own code); `model`: the
    native engine's weights when already in memory (--gpu), else read from `model_path`."""
    import torch

    from sparserl.actor.hf import load_model
    from sparserl.engine_options.build import build_rollout_engine, native_options, pool_slots
    from sparserl.engine_options.sizing import SequenceSize
    from sparserl.engines.native.engine import NativeEngine

    device = torch.device(device)
    size = SequenceSize(longest, cfg.rollout.max_new_tokens)
    slots = pool_slots(cfg, longest, 1, model_path, device)
    if cfg.rollout.engine != "native":
        return build_rollout_engine(cfg, model_path, tokenizer, device, slots, cfg.trainer.seed, size)
    model = model if model is not None else load_model(model_path, cfg.rollout.dtype, device)
    return NativeEngine(model, tokenizer, options=native_options(cfg, slots), seed=cfg.trainer.seed)


def generate(engine, cfg, prompts: list[list[int]]):
    """(generations, the engine's stats, wall seconds) of one rollout of `prompts`, `rollout.n` samples each."""
    from sparserl.engine_options.build import sampling_params
    from sparserl.engines.types import GenerationRequest

    params = sampling_params(cfg)
    engine.reset_stats()
    t0 = time.perf_counter()
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    return gens, engine.stats(), wall


def warm_up(engine, cfg, prompt: list[int]) -> None:
    """One short generate (kernels, packed weights, captured graphs for small batches), not timed."""
    from sparserl.engines.types import GenerationRequest, SamplingParams

    engine.generate([GenerationRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=4, n=2), 0)])


def xi_p05(model, gens, device) -> float:
    """5th percentile of xi = p_dense / p_sampler over every sampled token: the tokens scored by the same weights with
    a dense cache, in micro-batches of ~4k tokens."""
    import torch

    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs

    log_xi, chunk = [], []

    def flush():
        seqs = PackedSeqs([g.prompt_token_ids + g.token_ids for g in chunk], [len(g.prompt_token_ids) for g in chunk])
        with torch.inference_mode():
            dense, _ = packed_logprobs(model, seqs, torch.device(device))
        dense = dense.float().cpu()
        for i, g in enumerate(chunk):
            log_xi.append(dense[i, : len(g.token_ids)] - torch.tensor(g.logp_sparse))
        chunk.clear()

    for g in gens:
        chunk.append(g)
        if sum(len(c.prompt_token_ids) + len(c.token_ids) for c in chunk) >= 4096:
            flush()
    if chunk:
        flush()
    return float(torch.quantile(torch.cat(log_xi).double(), 0.05).exp())


def budget_of(cfg) -> dict:
    """The row's compression budget as it rolls out, and the controller's range under `budget=auto`."""
    kv = cfg.rollout.kv
    if kv.algorithm == "none":
        return {}
    return {"budget": kv.with_budget().budget,
            **({"range": f"{kv.control.floor}-{kv.control.ceiling}"} if kv.auto_budget else {})}


def rewards(gens, answers: list[str | None], env) -> float | None:
    if env is None or any(a is None for a in answers) or any(g.text is None for g in gens):
        return None
    return sum(env.score(g.text, answers[int(g.request_id)]) for g in gens) / len(gens)


def rollout_half(row: Row, cfg, model_path: str, tokenizer, prompts: Prompts, longest: int, device, env=None,
                 model=None, with_xi: bool = False) -> dict:
    """Everything the table's rollout columns need from one rollout of `prompts` under `row`'s config."""
    engine = build_engine(cfg, model_path, tokenizer, device, longest, model)
    keep_weights = cfg.rollout.engine == "native" and (with_xi or model is not None)
    try:
        warm_up(engine, cfg, prompts.ids[0])
        gens, st, wall = generate(engine, cfg, prompts.ids)
    finally:
        if keep_weights:  # the pool goes; the weights stay (the dense scoring, the next row's engine)
            engine.release_weights = False
            engine.sleep()
        else:
            engine.close()
    res = {"tok_s": st.new_tokens / wall, "wall_s": wall, "new_tokens": st.new_tokens,
           "mean_running": st.mean_running, "peak_running": st.peak_running, "retractions": st.retractions,
           "recomputed": st.recomputed_tokens, "peak_kv_bytes": st.peak_kv_bytes, "pool_slots": st.pool_slots,
           "bytes_per_slot": st.kv_bytes_per_slot, **budget_of(cfg),
           "mean_len": sum(len(g.token_ids) for g in gens) / len(gens), "reward": rewards(gens, prompts.answers, env),
           "kept": sum(g.kv.retained_tokens for g in gens) / max(1, sum(g.kv.total_tokens for g in gens)),
           "graph_capture_s": st.extra.get("rollout/graph_capture_s"),
           "tokens": [g.token_ids for g in gens], "logps": [g.logp_sparse for g in gens]}
    if with_xi and cfg.rollout.engine == "native":
        res["xi_p05"] = xi_p05(engine.runner.model, gens, device)
    if keep_weights and model is None:
        engine.close()  # this row's own weights (and their packed copies) go with it
    return res


# ----------------------------------------------------------------------------- models


def tiny_model(folder: Path) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (the offline alias), saved once into `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparserl.actor.hf import load_tokenizer

    if (folder / "config.json").exists():
        return str(folder)
    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=151645, bos_token_id=151643)
TINY_QWEN = dict(QWEN25_15B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, bos_token_id=0)


def random_model(shape: str, folder: Path, device, dtype):
    """(folder holding only its config.json, the model with random weights on `device`) at `shape`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**(QWEN25_15B if shape == "qwen2.5-1.5b" else TINY_QWEN))
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return str(folder), model.eval()
