"""The loop the preference trainers share (trainer/rm.py, trainer/dpo.py): pairs in, a step per batch of pairs,
held-out evaluation, checkpoints, resume, the HF export.

Data: JSONL rows with `data.prompt_key` (a string or chat messages), `chosen` and `rejected` (strings). Prompts
are formatted as every trainer formats them (chat template, `data.system_prompt`); a pair's two sequences are
prompt + response (+ EOS where the objective says so), rows (2k, 2k + 1) of the batch. `data.train_path` empty:
the shipped pairs (data/preference/), whose held-out file is then the evaluation set unless `<rm|dpo>.eval_path`
names another. `trainer.prompts_per_step` is the number of pairs per step, split over the DP ranks.
Checkpoints are the GRPO trainer's (actor/checkpoint.py: model, optimizer, `trainer_state.pt` with the step, LR
schedule, settings and run id) every `trainer.save_every` steps and at the end; `trainer.resume` continues one,
on any number of processes (the batch stream is replayed from the seed to the resumed step).
Left out on purpose: pairs without a shared prompt (a chosen and a rejected conversation that differ earlier),
and preemption signals (a run is short; resume from its last checkpoint).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from sparserl.actor import checkpoint
from sparserl.actor.actor import TrainBatch
from sparserl.config import Config
from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.parallel import all_reduce_sum
from sparserl.trainer import resume as resume_lib
from sparserl.trainer.preflight import check_output
from sparserl.trainer.run_dir import RUN_ID, check_run_id
from sparserl.trainer.supervised import batches, open_run, read_jsonl, share
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0, progress
from sparserl.utils.memory import reuse_heap
from sparserl.utils.runs import new_run_id, read_run_id

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "preference"
SHIPPED_TRAIN, SHIPPED_TEST = SHIPPED / "math_pairs_train.jsonl", SHIPPED / "math_pairs_test.jsonl"
CHOSEN, REJECTED = "chosen", "rejected"
LOG_EVERY = 10  # a console line every this many steps (and at the first and the last)


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]  # response tokens
    rejected: list[int]


def pair_paths(cfg: Config, section) -> tuple[str, str]:
    """(training file, held-out file or '') for `section` (cfg.rm or cfg.dpo)."""
    train = cfg.data.train_path or str(SHIPPED_TRAIN)
    held_out = section.eval_path or ("" if cfg.data.train_path else str(SHIPPED_TEST))
    return train, held_out


def read_pairs(path: str, key: str, prompt_key: str) -> list[dict]:
    """The rows of a pair file; one without a prompt or without string `chosen` / `rejected` is a UserError."""
    records = read_jsonl(path, key)
    if not records:
        raise UserError(f"{key}={path}: no rows")
    for i, rec in enumerate(records):
        ok = isinstance(rec, dict) and rec.get(prompt_key) and all(isinstance(rec.get(k), str) and rec.get(k)
                                                                   for k in (CHOSEN, REJECTED))
        if not ok:
            have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise UserError(f"{key}={path} row {i}: needs a non-empty {prompt_key!r} and non-empty strings "
                            f"{CHOSEN!r} and {REJECTED!r} (it has {have})")
    return records


def tokenize_pairs(cfg: Config, records: list[dict], source: str, tokenizer, max_length: int, eos: bool) -> list[Pair]:
    """Token ids of each pair (rows checked by `read_pairs`)."""
    end = [tokenizer.eos_token_id] if eos else []
    if eos and tokenizer.eos_token_id is None:
        raise UserError(f"model.path={cfg.model.path}: the tokenizer has no EOS token to end the responses with")
    out, too_long = [], 0
    for i, rec in enumerate(records):
        try:
            text = format_prompt(PromptRow(prompt=rec[cfg.data.prompt_key], answer=None, index=i), tokenizer, cfg.data.apply_chat_template,
                                 cfg.data.system_prompt)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{source} row {i}: {e}") from None
        p = tokenizer(text, add_special_tokens=False)["input_ids"]
        c = tokenizer(rec[CHOSEN], add_special_tokens=False)["input_ids"] + end
        r = tokenizer(rec[REJECTED], add_special_tokens=False)["input_ids"] + end
        if len(p) + max(len(c), len(r)) > max_length or len(p) > cfg.data.max_prompt_tokens:
            too_long += 1
            continue
        out.append(Pair(p, c, r))
    if too_long:
        log0(f"{source}: skipping {too_long} of {len(records)} pairs longer than the length limit")
    if not out:
        raise UserError(f"{source}: no usable pairs")
    return out


def pair_batch(pairs: list[Pair]) -> TrainBatch:
    """Pairs as the actor's batch: rows (2k, 2k + 1) = (chosen, rejected); the response tokens are the trained ones."""
    ids, prompt_lens = [], []
    for p in pairs:
        for resp in (p.chosen, p.rejected):
            ids.append(p.prompt + resp)
            prompt_lens.append(len(p.prompt))
    width = max((len(x) - n for x, n in zip(ids, prompt_lens)), default=1)
    mask = torch.zeros(len(ids), width)
    for row, (x, n) in enumerate(zip(ids, prompt_lens)):
        mask[row, : len(x) - n] = 1.0
    return TrainBatch(ids=ids, prompt_lens=prompt_lens, mask=mask, advantages=torch.zeros(len(ids)))


def reduce_sums(sums: dict[str, torch.Tensor | float], count: float, group, device) -> dict[str, float]:
    """Per-pair sums of every DP rank over the global pair count: means (one all-reduce)."""
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys] + [count], dtype=torch.float64, device=device)
    all_reduce_sum(t, group)
    n = max(float(t[-1]), 1.0)
    return {k: float(v) / n for k, v in zip(keys, t[:-1].tolist())}


class Objective(Protocol):
    """What a preference trainer adds to the loop."""

    actor: object  # an Actor: model, optimizer, scheduler, dp_group, device

    def train_step(self, pairs: list[Pair], ids: list[int]) -> dict[str, float]: ...

    def evaluate(self, pairs: list[Pair], ids: list[int]) -> dict[str, float]: ...

    def export(self, cfg: Config, tokenizer, rank: int) -> None: ...


def run(cfg: Config, name: str, section, objective: Objective, train: list[Pair], held_out: list[Pair], tokenizer,
        info, dims, mesh, header: str, console_keys: tuple[str, ...]) -> None:
    """The steps from the resumed one (or 1) to `trainer.total_steps`, evaluation, checkpoints and the export."""
    actor, t = objective.actor, cfg.trainer
    dp_rank = mesh["dp"].get_local_rank()
    start, run_id = resume_into(cfg, actor)
    logger = open_run(cfg, info.rank, header, run_id, resumed=start > 0)
    logger.truncate_after(start if start > 0 else -1)
    log0(f"{name}: {len(train)} training pairs, {len(held_out)} held out, {t.prompts_per_step} pairs per step, "
         f"{t.total_steps} steps, dp={dims.dp} cp={dims.cp} tp={dims.tp}; output: {Path(t.output_dir).resolve()}")
    stream = batches(len(train), min(t.prompts_per_step, len(train)), t.seed, cfg.data.shuffle)
    for _ in range(start):  # the batches the resumed steps took
        next(stream)
    mine = share(list(range(len(held_out))), dp_rank, dims.dp)

    def evaluate(step: int) -> dict[str, float]:
        if not held_out:
            return {}
        metrics = objective.evaluate([held_out[i] for i in mine], mine)
        log0(f"{name} eval at step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    if start == 0 and held_out:
        logger.log(0, evaluate(0))
    with progress(t.total_steps - start, name, info.rank, cfg.logger.progress) as bar, reuse_heap():
        for step in range(start + 1, t.total_steps + 1):
            t0 = time.perf_counter()
            ids = share(next(stream), dp_rank, dims.dp)
            metrics = objective.train_step([train[i] for i in ids], ids)
            metrics["perf/step_s"] = time.perf_counter() - t0
            loss = metrics[f"{name}/loss"]
            if not math.isfinite(loss):
                raise UserError(f"{name} step {step}: the loss is {loss}; lower actor.lr={cfg.actor.lr}")
            last = step == t.total_steps
            if last or (section.eval_every and step % section.eval_every == 0):
                metrics.update(evaluate(step))
            logger.log(step, metrics)
            bar.update(1)
            if step == start + 1 or step % LOG_EVERY == 0 or step == t.total_steps:
                log0(f"step {step}/{t.total_steps} | " + " | ".join(f"{k.split('/')[-1]} {metrics[k]:.4f}"
                                                                  for k in console_keys) +
                     f" | gnorm {metrics['actor/grad_norm']:.3g} | lr {metrics['actor/lr']:.2e} | {metrics['perf/step_s']:.1f} s")
            if (t.save_every and step % t.save_every == 0) or last:
                save(cfg, actor, step, run_id, info.rank)
    logger.close()
    if t.export_hf:
        objective.export(cfg, tokenizer, info.rank)


def resume_into(cfg: Config, actor) -> tuple[int, str]:
    """(the step to go on from, the run id): `trainer.resume`'s checkpoint loaded into the actor, or (0, a new id)."""
    path = checkpoint.resolve_resume(cfg.trainer.resume, cfg.trainer.output_dir)
    if path is None:
        return 0, (read_run_id(cfg.trainer.output_dir) if cfg.trainer.resume != "none" else None) or new_run_id()
    state = checkpoint.load(path, actor.model, actor.optimizer)
    check_run_id(cfg, state, path)
    actor.scheduler.load_state_dict(state["scheduler"])
    resume_lib.restore_skips(state, actor)
    log0(f"resumed from {path} at step {state['step']}")
    return int(state["step"]), str(state.get(RUN_ID) or new_run_id())


def save(cfg: Config, actor, step: int, run_id: str, rank: int) -> None:
    state = {"step": step, "scheduler": actor.scheduler.state_dict(), RUN_ID: run_id,
             resume_lib.SETTINGS: resume_lib.settings(cfg), resume_lib.SKIPS: actor.consecutive_skips}
    path = checkpoint.save(cfg.trainer.output_dir, step, actor.model, actor.optimizer, state, rank, cfg.trainer.keep_last)
    log0(f"saved {path}")


def train_pairs(cfg: Config, name: str, root: str, header: str, make_objective, eos: bool,
                console: tuple[str, ...]) -> None:
    """A pair trainer's whole run (`name`: "rm" or "dpo", its config section): the pairs read and checked before
    anything is written, the processes, the tokenized pairs, `make_objective(cfg, model_path, mesh, device)`, the
    loop."""
    from sparserl.actor.hf import load_tokenizer, resolve_model_path
    from sparserl.parallel import teardown
    from sparserl.trainer.build import start_processes
    from sparserl.utils.seed import set_seed

    section = getattr(cfg, name)
    preflight(cfg, root)
    train_path, eval_path = pair_paths(cfg, section)
    records = read_pairs(train_path, "data.train_path", cfg.data.prompt_key)  # user errors surface here, before anything is written
    held_records = read_pairs(eval_path, f"{name}.eval_path", cfg.data.prompt_key) if eval_path else []
    model_path = resolve_model_path(cfg.model.path)
    set_seed(cfg.trainer.seed)
    info, dims, mesh = start_processes(cfg, root)
    tokenizer = load_tokenizer(model_path)
    train = tokenize_pairs(cfg, records, f"data.train_path={train_path}", tokenizer, section.max_length, eos=eos)
    held_out = tokenize_pairs(cfg, held_records, f"{name}.eval_path={eval_path}", tokenizer, section.max_length,
                              eos=eos) if held_records else []
    if section.eval_limit:
        held_out = held_out[: section.eval_limit]
    objective = make_objective(cfg, model_path, mesh, info.device)
    run(cfg, name, section, objective, train, held_out, tokenizer, info, dims, mesh, header, console)
    teardown()


def preflight(cfg: Config, root: str) -> None:
    if cfg.trainer.total_steps < 1:
        raise UserError(f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1")
    check_output(cfg, root)
