"""Group-relative advantages: one scalar per sampled sequence, from the rewards of its prompt's group.

Rewards arrive as (G, n): G prompts, n samples each, all generated on this rank (prompts are sharded by
DP rank and a group never spans ranks), so nothing here communicates.

`valid` marks the members that count in the baseline. Invalid members (e.g. sequences rejected by the
correction when `algo.correction.rejected_in_baseline=False`, or failed generations) get advantage 0
and do not enter the mean or the std.

Left out on purpose: GAE / critics, RLOO, REINFORCE++ and batch-level reward scaling; they are one
registered function each when needed. Overlong reward shaping belongs to the reward side, not here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from sparserl.algo.aggregation import metrics_to_floats

AdvEstimator = Callable[[Tensor, Tensor, float], Tensor]
ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    def deco(fn: AdvEstimator) -> AdvEstimator:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


def _group_stats(r: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Masked group mean, sample std, and whether the group is constant over its valid members."""
    v = valid.to(r.dtype)  # (G, n)
    count = v.sum(-1, keepdim=True)  # (G, 1)
    r0 = torch.where(valid, r, torch.zeros_like(r))  # (G, n)
    mean = r0.sum(-1, keepdim=True) / count.clamp(min=1.0)  # (G, 1)
    sq = torch.where(valid, (r - mean) ** 2, torch.zeros_like(r))  # (G, n)
    std = (sq.sum(-1, keepdim=True) / (count - 1.0).clamp(min=1.0)).sqrt()  # (G, 1)
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(-1, keepdim=True)  # (G, 1)
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(-1, keepdim=True)  # (G, 1)
    # Compared exactly instead of std == 0: the float mean of equal values need not equal them, and a
    # group with one valid member (or none) has no spread to learn from either.
    constant = (hi <= lo) | (count <= 1.0)  # (G, 1)
    return mean, std, constant


@register_adv_estimator("grpo")
def grpo(rewards: Tensor, valid: Tensor, eps: float) -> Tensor:
    """(r - mean) / (std + eps), with the sample (Bessel-corrected) std, as GRPO, verl and slime use."""
    mean, std, constant = _group_stats(rewards, valid)
    adv = (rewards - mean) / (std + eps)  # (G, n)
    return torch.where(constant | ~valid, torch.zeros_like(adv), adv)


@register_adv_estimator("drgrpo")
def drgrpo(rewards: Tensor, valid: Tensor, eps: float) -> Tensor:
    """r - mean: Dr.GRPO drops the std, which over-weights groups that are nearly all right or all wrong."""
    mean, _, constant = _group_stats(rewards, valid)
    adv = rewards - mean  # (G, n)
    return torch.where(constant | ~valid, torch.zeros_like(adv), adv)


def compute_advantages(
    name: str, rewards: Tensor, valid: Tensor | None = None, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """Advantages (G, n) for rewards (G, n); `valid` (G, n) bool, default all valid.

    A group whose valid members all have the same reward gets advantage exactly 0.
    """
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (algo.adv_estimator); valid: {sorted(ADV_ESTIMATORS)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, n) = (prompts, samples per prompt), got shape {tuple(rewards.shape)}")
    r = rewards.detach()
    r = r if r.is_floating_point() else r.to(torch.float32)
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    if valid.shape != r.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must match rewards {tuple(r.shape)}")
    adv = ADV_ESTIMATORS[name](r, valid, eps)  # (G, n)

    _, _, constant = _group_stats(r, valid)
    v = valid.to(r.dtype)
    n_valid = v.sum().clamp(min=1.0)
    adv_mean = (adv * v).sum() / n_valid
    metrics = {
        "adv/mean": adv_mean,
        "adv/std": (((adv - adv_mean) ** 2 * v).sum() / n_valid).sqrt(),
        "adv/abs_max": (adv.abs() * v).amax() if adv.numel() else r.new_zeros(()),
        "adv/zero_std_group_frac": constant.to(r.dtype).mean() if adv.numel() else r.new_zeros(()),
        "adv/valid_frac": v.mean() if adv.numel() else r.new_zeros(()),
    }
    return adv, metrics_to_floats(metrics)
