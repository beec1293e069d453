"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine to min_lr_ratio).

Left out on purpose: other optimizers, parameter groups without weight decay for norms/biases.
"""
from __future__ import annotations

import math

import torch

from sparserl.utils.errors import UserError


def build_optimizer(params, lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=1e-8)


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float):
    if schedule not in ("constant", "cosine"):
        raise UserError(f"actor.lr_schedule={schedule!r}: choose constant or cosine")

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(opt, schedule: str, warmup: int, total: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule, warmup, total, min_ratio))
