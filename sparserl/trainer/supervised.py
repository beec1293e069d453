"""What the trainers on fixed data share (SFT, the reward model, DPO): JSONL records, seeded index batches, each DP
rank's share, the actor's settings from the config, and the run folder with its config.yaml and metrics logger.

The GRPO trainer builds its own actor (trainer/build.py `build_actor`: sampling transform, shared prompts, zero
advantages); these trainers pass `actor_options(cfg)` to an `Actor` (or a subclass) instead.
Left out on purpose: streaming a file larger than memory (the shipped sets are a few MB).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from sparserl.config import Config, to_dict, to_yaml
from sparserl.utils.errors import UserError
from sparserl.utils.logging import MetricsLogger
from sparserl.utils.runs import new_run_id, write_run_file


def read_jsonl(path: str | Path, key: str) -> list[dict]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped); `key` names the setting in errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{key}={path}: no such file")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{key}={path} line {n}: not JSON ({e.msg})") from None
    return records


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


def share(batch: list[int], dp_rank: int, dp: int) -> list[int]:
    """This DP rank's examples of a batch (every rank draws the same batch)."""
    return batch[dp_rank::dp]


def actor_options(cfg: Config) -> dict:
    """The `Actor` keyword arguments these trainers take from the config (dtypes, AdamW, schedule, packing, LoRA)."""
    a = cfg.actor
    return dict(dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype, lr=a.lr, betas=a.betas,
                weight_decay=a.weight_decay, lr_schedule=a.lr_schedule, warmup_steps=a.warmup_steps,
                total_steps=cfg.trainer.total_steps, min_lr_ratio=a.min_lr_ratio, max_grad_norm=a.max_grad_norm,
                max_tokens_per_device=a.max_tokens_per_device,
                activation_checkpointing=cfg.model.activation_checkpointing, logprob_chunk_mb=a.logprob_chunk_mb,
                lora=a.lora, seed=cfg.trainer.seed)


def open_run(cfg: Config, rank: int, header: str, run_id: str | None = None, resumed: bool = False) -> MetricsLogger:
    """config.yaml (its first line `header`: which trainer wrote it) and run.json on rank 0 of a new run; the metrics
    logger (a resumed run keeps its folder's run.json)."""
    out = Path(cfg.trainer.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(header + to_yaml(cfg))
        if not resumed:
            write_run_file(out, run_id or new_run_id())
    return MetricsLogger(out, rank, to_dict(cfg), cfg.logger.wandb.mode, cfg.logger.wandb.project,
                         cfg.logger.wandb.name, console=False, total_steps=cfg.trainer.total_steps)
