"""`auto` precision and CPU threads, resolved once per run for this hardware (the same choice on every rank).

Left out on purpose: per-module precision (the actor's compute dtype and the engine's dtype are the only two).
"""
from __future__ import annotations

import torch

from sparserl.config import Config
from sparserl.utils import precision
from sparserl.utils.logging import log0


def resolve_precision(cfg: Config, device: torch.device) -> None:
    """Replace `auto` in model.compute_dtype / rollout.dtype with what this hardware runs fast (same on every
    rank), set the CPU thread count, and say both once (utils/precision.py)."""
    if device.type == "cpu":
        torch.set_num_threads(precision.cpu_threads())
    keys = [k for k, v in (("model.compute_dtype", cfg.model.compute_dtype), ("rollout.dtype", cfg.rollout.dtype)) if v == "auto"]
    if keys:
        choice = precision.agree(precision.choose_auto(device))
        cfg.model.compute_dtype = precision.resolve(cfg.model.compute_dtype, choice)
        cfg.rollout.dtype = precision.resolve(cfg.rollout.dtype, choice)
        log0(f"precision: {', '.join(keys)}=auto -> {choice.dtype}: {choice.reason}")
    if device.type == "cpu":
        log0(f"cpu threads per process: {torch.get_num_threads()}")
