"""`python -m sparserl.trainer.sft key=value ...`: a short supervised warm-start before GRPO.

Same Hydra config as `sparserl.trainer.grpo` (no keys of its own): `model.*` picks the checkpoint and the
dtypes, `actor.lr` / `actor.betas` / `actor.weight_decay` / `actor.lr_schedule` / `actor.warmup_steps` /
`actor.max_grad_norm` the AdamW update, `actor.max_tokens_per_device` the packed micro-batch size, `actor.lora.*`
LoRA adapters, `model.activation_checkpointing`, `trainer.prompts_per_step` the batch size, `trainer.total_steps` the number of updates,
`trainer.output_dir` where `metrics.jsonl`, `config.yaml` and the trained policy `hf/` go (`auto`, the default: a new
`outputs/sft/<date-time>/` per run, `outputs/sft/latest` pointing to the newest; a named folder that holds a run
only with `trainer.overwrite=true`).

Examples come from `data.train_path` (a JSONL file whose rows hold `data.prompt_key`, a string or chat
messages, and `response`) or, when that is empty, from the env module's `make_sft_examples(num, seed)`
(`data.num_generated` examples, `trainer.seed`). Prompts are formatted exactly as the GRPO trainer formats
them (chat template, `data.system_prompt`), the target is the response followed by the tokenizer's EOS,
and the loss is the mean cross-entropy over target tokens only. `model.path=<output_dir>/hf` (or
`model.path=outputs/sft/latest/hf`) then starts GRPO from the result.

It trains the GRPO trainer's actor (`actor/actor.py`): packed micro-batches, FSDP2, and under torchrun the same
`parallel.tp` and `parallel.cp` (one long example split over the cp ranks, ring attention), each DP rank taking
its share of every batch. The loss is a loss function of the actor's (per-token log-probs of the targets).

Left out on purpose: evaluation, checkpoints and resume (a warm-start is short; rerun it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparserl.actor.actor import Actor, Normalizer, TrainBatch
from sparserl.actor.export import export_final
from sparserl.actor.hf import load_tokenizer, resolve_model_path
from sparserl.cli import run_entry
from sparserl.config import SFT_CONFIG_HEADER, Config
from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.parallel import all_reduce_sum, teardown
from sparserl.trainer.build import start_processes
from sparserl.trainer.preflight import check_output
from sparserl.trainer.run_dir import SFT_ROOT
from sparserl.trainer.supervised import actor_options, batches, open_run, read_jsonl, share
from sparserl.utils.envload import load_env
from sparserl.utils.errors import UserError
from sparserl.utils.memory import reuse_heap
from sparserl.utils.logging import log0, progress
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
        return read_jsonl(cfg.data.train_path, "data.train_path"), f"data.train_path={Path(cfg.data.train_path)}"
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


def train_batch(examples: list[Example]) -> TrainBatch:
    """Examples as the actor's batch: the response tokens (target + EOS) are the trained tokens."""
    width = max((len(e.ids) - e.prompt_len for e in examples), default=1)
    mask = torch.zeros(len(examples), width)
    for row, e in enumerate(examples):
        mask[row, : len(e.ids) - e.prompt_len] = 1.0
    return TrainBatch(ids=[e.ids for e in examples], prompt_lens=[e.prompt_len for e in examples], mask=mask,
                      advantages=torch.zeros(len(examples)))


class NLLLoss:
    """The actor's loss function for SFT: summed -log p of the targets over the batch's target count (all DP
    ranks), so the micro-batches' gradients add up to the mean cross-entropy's. Keeps this rank's sums of -log p
    and p over the micro-batches it saw."""

    def __init__(self) -> None:
        self.nll = self.p = 0.0

    def __call__(self, logp: torch.Tensor, entropy, batch: TrainBatch, idx: torch.Tensor, norm: Normalizer):
        mask = batch.mask[idx, : logp.shape[1]]
        nll = -(logp * mask).sum()
        self.nll += float(nll.detach())
        self.p += float((logp.detach().exp() * mask).sum())
        return nll / norm.tokens, {}


def train(cfg: Config) -> None:
    if cfg.trainer.total_steps < 1:
        raise UserError(f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1")
    if cfg.trainer.prompts_per_step < 1:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} (the SFT batch size) must be >= 1")
    check_output(cfg, SFT_ROOT)
    records, source = read_examples(cfg)  # user errors surface here, before anything is written
    model_path = resolve_model_path(cfg.model.path)
    set_seed(cfg.trainer.seed)
    info, dims, mesh = start_processes(cfg, SFT_ROOT)
    tokenizer = load_tokenizer(model_path)
    examples = tokenize_examples(cfg, records, source, tokenizer)
    a = cfg.actor
    actor = Actor(model_path, mesh, info.device, share_prompts=False, **actor_options(cfg))
    dp_rank = mesh["dp"].get_local_rank()

    out = Path(cfg.trainer.output_dir)
    logger = open_run(cfg, info.rank, SFT_CONFIG_HEADER)
    logger.truncate_after(-1)
    log0(f"sft: {len(examples)} examples from {source}, batch {cfg.trainer.prompts_per_step}, "
         f"{cfg.trainer.total_steps} steps, dp={dims.dp} cp={dims.cp} tp={dims.tp}; output: {out.resolve()}")
    stream = batches(len(examples), min(cfg.trainer.prompts_per_step, len(examples)), cfg.trainer.seed, cfg.data.shuffle)

    # No engine here: the whole run is the actor's compute, so tensors up to 32 MiB reuse heap pages (utils/memory.py).
    with progress(cfg.trainer.total_steps, "sft", info.rank, cfg.logger.progress) as bar, reuse_heap():
        for step in range(1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            batch = train_batch([examples[i] for i in share(next(stream), dp_rank, dims.dp)])
            metrics = train_step(actor, batch)
            metrics["perf/step_s"] = time.perf_counter() - t0
            metrics["perf/train_tok_s"] = metrics.pop("tokens") / metrics["perf/step_s"]
            if not math.isfinite(metrics["actor/loss"]):
                raise UserError(f"sft step {step}: the loss is {metrics['actor/loss']}; lower actor.lr={a.lr}")
            logger.log(step, metrics)
            bar.update(1)
            if step == 1 or step % LOG_EVERY == 0 or step == cfg.trainer.total_steps:
                log0(f"step {step}/{cfg.trainer.total_steps} | loss {metrics['actor/loss']:.4f} | "
                     f"target p {metrics['actor/target_prob']:.3f} | gnorm {metrics['actor/grad_norm']:.3g} | "
                     f"lr {metrics['actor/lr']:.2e} | {metrics['perf/step_s']:.1f} s")
    logger.close()
    export_final(cfg, actor, tokenizer, info.rank)
    teardown()


def train_step(actor: Actor, batch: TrainBatch) -> dict[str, float]:
    """One AdamW update on this rank's share of the batch: gradients accumulated over packed micro-batches
    (the actor's), loss = mean cross-entropy over every DP rank's target tokens."""
    lr = actor.scheduler.get_last_lr()[0]
    index = list(range(len(batch)))
    loss = NLLLoss()
    actor.accumulate_gradients(batch, loss, index, with_entropy=False)
    grad_norm, _ = actor._step()
    sums = torch.tensor([loss.nll, float(batch.mask.sum()), loss.p, float(sum(batch.lengths()))],
                        dtype=torch.float64, device=actor.device)
    all_reduce_sum(sums, actor.dp_group)
    nll, targets, p_sum, tokens = sums.tolist()
    # actor/target_prob: the target tokens' mean probability before the step (a smooth token accuracy).
    return {"actor/loss": nll / targets, "actor/target_prob": p_sum / targets, "actor/grad_norm": grad_norm,
            "actor/lr": lr, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    run_entry(train, argv)


if __name__ == "__main__":
    main()
