"""`python -m sparserl.trainer.sft key=value ...`: a short supervised warm-start before GRPO.

Same Hydra config as `sparserl.trainer.grpo` (no keys of its own): `model.*` picks the checkpoint and the
dtypes, `actor.lr` / `actor.betas` / `actor.weight_decay` / `actor.lr_schedule` / `actor.warmup_steps` /
`actor.max_grad_norm` the AdamW update, `actor.max_tokens_per_device` the micro-batch size (padded tokens),
`trainer.prompts_per_step` the batch size, `trainer.total_steps` the number of updates,
`trainer.output_dir` where `metrics.jsonl`, `config.yaml` and the trained policy `hf/` go.

Examples come from `data.train_path` (a JSONL file whose rows hold `data.prompt_key`, a string or chat
messages, and `response`) or, when that is empty, from the env module's `make_sft_examples(num, seed)`
(`data.num_generated` examples, `trainer.seed`). Prompts are formatted exactly as the GRPO trainer formats
them (chat template, `data.system_prompt`), the target is the response followed by the tokenizer's EOS,
and the loss is the mean cross-entropy over target tokens only. `model.path=<output_dir>/hf` then starts
GRPO from the result.

Left out on purpose: several processes (one CPU or GPU process is enough for a warm-start), packing,
evaluation, checkpoints and resume (a warm-start is short; rerun it).
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparserl.actor.hf import export_hf, load_model, load_tokenizer, parse_dtype, resolve_model_path
from sparserl.actor.optim import build_optimizer, build_scheduler
from sparserl.cli import parse_cli
from sparserl.config import Config, to_dict, to_yaml
from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.parallel import choose_device
from sparserl.launch.precision import resolve_precision
from sparserl.utils.envload import load_env
from sparserl.utils.errors import UserError, run_main
from sparserl.utils.logging import MetricsLogger, log0, progress
from sparserl.utils.seed import set_seed

RESPONSE_KEY = "response"
LOG_EVERY = 10  # a console summary line every this many steps (and at the first and the last)


@dataclass
class Example:
    ids: list[int]  # prompt + response + EOS
    prompt_len: int


def read_examples(cfg: Config) -> tuple[list[dict], str]:
    """Raw {prompt, response} records and a name for their source (for error messages)."""
    if cfg.data.train_path:
        path = Path(cfg.data.train_path)
        if not path.is_file():
            raise UserError(f"data.train_path={path}: no such file")
        records = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"data.train_path={path} line {n}: not JSON ({e.msg})") from None
        return records, f"data.train_path={path}"
    env = load_env(cfg.env.path)
    make = getattr(env.module, "make_sft_examples", None)
    if make is None:
        raise UserError(f"data.train_path is empty and env.path={cfg.env.path} has no make_sft_examples(num, seed); "
                        "give a JSONL file")
    return make(cfg.data.num_generated, cfg.trainer.seed), f"env.path={cfg.env.path} make_sft_examples()"


def tokenize_examples(cfg: Config, records: list[dict], source: str, tokenizer) -> list[Example]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(f"model.path={cfg.model.path}: the tokenizer has no EOS token to end the responses with")
    out, too_long = [], 0
    for i, rec in enumerate(records):
        prompt = rec.get(cfg.data.prompt_key) if isinstance(rec, dict) else None
        response = rec.get(RESPONSE_KEY) if isinstance(rec, dict) else None
        if not prompt or not isinstance(response, str) or not response:
            raise UserError(f"{source} row {i}: needs a non-empty {cfg.data.prompt_key!r} and a non-empty string {RESPONSE_KEY!r}")
        try:
            text = format_prompt(PromptRow(prompt=prompt, answer=None, index=i), tokenizer, cfg.data.apply_chat_template,
                                 cfg.data.system_prompt)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{source} row {i}: {e}") from None
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) > cfg.data.max_prompt_tokens:
            too_long += 1
            continue
        target = tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
        out.append(Example(prompt_ids + target, len(prompt_ids)))
    if too_long:
        log0(f"skipping {too_long} of {len(records)} examples whose prompt is longer than "
             f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if not out:
        raise UserError(f"{source}: no usable examples")
    return out


def batches(num: int, batch_size: int, seed: int, shuffle: bool):
    """Endless index batches: each epoch a fresh permutation (seeded), the last partial batch carried over."""
    rng = random.Random(seed)
    pending: list[int] = []
    while True:
        order = list(range(num))
        if shuffle:
            rng.shuffle(order)
        pending += order
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]


def microbatches(examples: list[Example], max_tokens: int) -> list[list[Example]]:
    """Consecutive groups whose padded size (rows x longest) stays within `max_tokens` (one row at least)."""
    groups: list[list[Example]] = []
    for ex in sorted(examples, key=lambda e: len(e.ids)):
        if groups and (len(groups[-1]) + 1) * max(len(ex.ids), max(len(e.ids) for e in groups[-1])) <= max_tokens:
            groups[-1].append(ex)
        else:
            groups.append([ex])
    return groups


def response_loss(model, group: list[Example], pad_id: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy over the response tokens of `group`, their count and how many argmax hits."""
    width = max(len(e.ids) for e in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # (B, T), right-padded
    attn = torch.zeros((len(group), width), dtype=torch.long)
    target_mask = torch.zeros((len(group), width), dtype=torch.bool)  # (B, T): position t predicts token t + 1
    for row, e in enumerate(group):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        attn[row, : len(e.ids)] = 1
        target_mask[row, e.prompt_len - 1 : len(e.ids) - 1] = True
    ids, attn, target_mask = ids.to(device), attn.to(device), target_mask.to(device)
    hidden = model.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B, T, H)
    # The LM head runs only on rows that predict a response token: most of a row is prompt.
    logits = model.get_output_embeddings()(hidden[target_mask]).float()  # (N, V)
    targets = ids[:, 1:][target_mask[:, :-1]]  # (N,)
    loss = F.cross_entropy(logits, targets, reduction="sum")
    hits = int((logits.argmax(-1) == targets).sum())
    return loss, int(targets.numel()), hits


def train(cfg: Config) -> None:
    if cfg.trainer.total_steps < 1:
        raise UserError(f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1")
    if cfg.trainer.prompts_per_step < 1:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} (the SFT batch size) must be >= 1")
    records, source = read_examples(cfg)  # user errors surface here, before anything is written
    model_path = resolve_model_path(cfg.model.path)
    set_seed(cfg.trainer.seed)
    device = choose_device(cfg.parallel.device)
    resolve_precision(cfg, device)
    tokenizer = load_tokenizer(model_path)
    examples = tokenize_examples(cfg, records, source, tokenizer)
    model = load_model(model_path, cfg.model.dtype, device)
    model.train()
    a = cfg.actor
    optimizer = build_optimizer(model.parameters(), a.lr, a.betas, a.weight_decay)
    scheduler = build_scheduler(optimizer, a.lr_schedule, a.warmup_steps, cfg.trainer.total_steps, a.min_lr_ratio)
    compute = parse_dtype(cfg.model.compute_dtype)
    # Master weights in model.dtype, matmuls in model.compute_dtype (the GRPO actor's split).
    autocast = (lambda: torch.autocast(device.type, dtype=compute)) if compute != parse_dtype(cfg.model.dtype) else nullcontext

    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    logger = MetricsLogger(out, 0, to_dict(cfg), cfg.logger.wandb.mode, cfg.logger.wandb.project, cfg.logger.wandb.name,
                           console=False, total_steps=cfg.trainer.total_steps)
    logger.truncate_after(-1)
    log0(f"sft: {len(examples)} examples from {source}, batch {cfg.trainer.prompts_per_step}, "
         f"{cfg.trainer.total_steps} steps; output: {out.resolve()}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stream = batches(len(examples), min(cfg.trainer.prompts_per_step, len(examples)), cfg.trainer.seed, cfg.data.shuffle)

    with progress(cfg.trainer.total_steps, "sft", 0, cfg.logger.progress) as bar:
        for step in range(1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            metrics = train_step(model, optimizer, [examples[i] for i in next(stream)], a.max_tokens_per_device,
                                 a.max_grad_norm, pad_id, device, autocast)
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
            scheduler.step()
            metrics["perf/step_s"] = time.perf_counter() - t0
            metrics["perf/train_tok_s"] = metrics.pop("tokens") / metrics["perf/step_s"]
            if not math.isfinite(metrics["actor/loss"]):
                raise UserError(f"sft step {step}: the loss is {metrics['actor/loss']}; lower actor.lr={a.lr}")
            logger.log(step, metrics)
            bar.update(1)
            if step == 1 or step % LOG_EVERY == 0 or step == cfg.trainer.total_steps:
                log0(f"step {step}/{cfg.trainer.total_steps} | loss {metrics['actor/loss']:.4f} | "
                     f"token acc {metrics['actor/token_acc']:.3f} | gnorm {metrics['actor/grad_norm']:.3g} | "
                     f"lr {metrics['actor/lr']:.2e} | {metrics['perf/step_s']:.1f} s")
    logger.close()
    path = export_hf(model, tokenizer, out / "hf")
    log0(f"exported the fine-tuned policy to {path}")


def train_step(model, optimizer, batch: list[Example], max_tokens: int, max_grad_norm: float, pad_id: int,
               device: torch.device, autocast) -> dict[str, float]:
    """One AdamW update on `batch`: gradients accumulated over micro-batches, loss = mean over target tokens."""
    num_targets = sum(len(e.ids) - e.prompt_len for e in batch)
    total_loss, hits = 0.0, 0
    for group in microbatches(batch, max_tokens):
        with autocast():
            loss, _, group_hits = response_loss(model, group, pad_id, device)
        (loss / num_targets).backward()
        total_loss += float(loss.detach())
        hits += group_hits
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"actor/loss": total_loss / num_targets, "actor/token_acc": hits / num_targets,
            "actor/grad_norm": float(grad_norm), "tokens": sum(len(e.ids) for e in batch)}


def main(argv: list[str] | None = None) -> None:
    def run() -> None:
        cfg = parse_cli(sys.argv[1:] if argv is None else argv, "grpo")
        if cfg is not None:  # None: --help or --cfg job was answered
            train(cfg)

    run_main(run)


if __name__ == "__main__":
    main()
