"""Overlong responses (DAPO): the soft length penalty on the reward and the mask that takes cut responses out of
the loss. Pure tensor functions on per-sequence lengths and flags; the trainer decides what a length is and which
sequence was cut (trainer/advantages.py, trainer/train_batch.py).

DAPO's soft punishment, with L = the length cap and B = the buffer:

    ramp(len) = 0                     if len <= L - B
              = (len - (L - B)) / B   if L - B < len <= L     (1 at the cap)
    reward'   = reward - penalty * ramp(len)

Left out on purpose: DAPO's hard variant (reward set to a constant for cut responses; `mask` plus the ramp
covers both uses) and penalties on lengths past the cap (a response never exceeds it).
"""
from __future__ import annotations

import torch
from torch import Tensor


def overlong_ramp(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """(B,) float in [0, 1]: 0 up to `max_len - buffer` tokens, rising linearly to 1 at `max_len`."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_len={max_len}]")
    start = max_len - buffer
    return ((lengths.to(torch.float32) - start) / buffer).clamp(0.0, 1.0)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """(B,) what DAPO subtracts from each reward: `penalty` x the ramp (zeros when `penalty` is 0)."""
    if penalty == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    return penalty * overlong_ramp(lengths, max_len, buffer)


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """The loss mask (B, T) with every token of the truncated sequences (B,) bool set to 0."""
    return mask * (~truncated.to(torch.bool)).to(mask.dtype)[:, None]
