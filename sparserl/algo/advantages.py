"""Advantage estimators, registered by name (`algo.adv_estimator`): pure functions of the step's rewards, masks
and, for an estimator that reads them (`Estimator.uses_values`: gae), a critic's values (`AdvInputs`).

An estimator returns one advantage per sequence, (G, n), which the loss broadcasts over the sequence's tokens, or
one per token, (B, T), with B = G x n rows in group order and 0 off the mask:
  * group baselines, (G, n): grpo, drgrpo, rloo. Rewards arrive as (G, n): G prompts, n samples each, all generated
    on this rank (prompts are sharded by DP rank and a group never spans ranks), so they need no communication. A
    KL penalty in the reward (`token_rewards`, `algo.kl.mode=reward`) enters as its sum over the sequence.
  * REINFORCE++ (reinforce_pp, reinforce_pp_baseline), (B, T): each token's return (the per-token rewards of the
    tokens from it on plus the sequence's reward at its last token, undiscounted), whitened over the masked tokens
    of the whole batch: every DP rank's, summed by `reduce_sum` (two all-reduces of float64 sums).
  * GAE (gae), (B, T): generalized advantage estimation over each row's masked tokens with a critic's values (the
    value of the state each token is sampled in), `gamma` and `lam`; the sequence's reward at its last masked token,
    the per-token rewards (the KL penalty) on every one, 0 after the last. Tokens off the mask (a multi-turn episode's
    env tokens) are skipped: the recursion runs from one masked token to the next, so the value bootstraps across
    them. The advantages are whitened over the batch as REINFORCE++'s; the critic's targets are the unwhitened
    advantages plus the values (`gae_returns`).

`valid` marks the members that count in the statistics (group baselines, batch whitening). Invalid members (e.g.
sequences rejected by the correction when `algo.correction.rejected_in_baseline=False`) get advantage 0 and enter
neither a mean nor a std. `mask` holds the tokens that get advantages: the loss mask at the time they are computed.

Each estimator also says whether it has a group baseline (`Estimator.group_baseline`): with one, a group whose
valid rewards all tie carries no reward signal (`reward_signal`, what dynamic sampling judges); without one
(reinforce_pp) every reward is measured against the batch's, so every valid member has one.

Left out on purpose: discounting (gamma = 1) for REINFORCE++ and batch-level reward scaling for the group
estimators; GAE without whitening. Overlong reward shaping belongs to the
reward side, not here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from sparserl.algo.aggregation import metrics_to_floats

Reduce = Callable[[Tensor], Tensor]


def _local(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class AdvInputs:
    """What an estimator may read. Per-token tensors are (G*n, T), rows in group order."""

    rewards: Tensor  # (G, n) each sample's scalar reward
    valid: Tensor  # (G, n) bool: the members counted in baselines and batch statistics
    eps: float = 1e-6
    mask: Tensor | None = None  # (G*n, T) float: the tokens that get advantages; per-token estimators need it
    token_rewards: Tensor | None = None  # (G*n, T) per-token rewards (minus the KL penalty), 0 off the mask
    values: Tensor | None = None  # (G*n, T) a critic's value of each token's state (gae reads it)
    reduce_sum: Reduce = _local  # sums a small float64 tensor over the DP ranks (batch statistics)
    gamma: float = 1.0  # gae: the discount per model token
    lam: float = 1.0  # gae: the GAE lambda


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvInputs], Tensor]
    per_token: bool  # returns (G*n, T) instead of (G, n)
    group_baseline: bool  # centred on its group: a group whose rewards tie gets no reward signal
    uses_values: bool = False  # reads a critic's values (AdvInputs.values)


ADV_ESTIMATORS: dict[str, Estimator] = {}


def register_adv_estimator(name: str, *, per_token: bool = False, group_baseline: bool = True,
                           uses_values: bool = False) -> Callable[[Callable], Callable]:
    def deco(fn: Callable[[AdvInputs], Tensor]) -> Callable[[AdvInputs], Tensor]:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = Estimator(fn, per_token, group_baseline, uses_values)
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


# ------------------------------------------------------------------------------------------- group baselines
@register_adv_estimator("grpo")
def grpo(x: AdvInputs) -> Tensor:
    """(r - mean) / (std + eps), with the sample (Bessel-corrected) std, as GRPO, verl and slime use."""
    mean, std, constant = _group_stats(x.rewards, x.valid)
    adv = (x.rewards - mean) / (std + x.eps)  # (G, n)
    return torch.where(constant | ~x.valid, torch.zeros_like(adv), adv)


@register_adv_estimator("drgrpo")
def drgrpo(x: AdvInputs) -> Tensor:
    """r - mean: Dr.GRPO drops the std, which over-weights groups that are nearly all right or all wrong."""
    mean, _, constant = _group_stats(x.rewards, x.valid)
    adv = x.rewards - mean  # (G, n)
    return torch.where(constant | ~x.valid, torch.zeros_like(adv), adv)


@register_adv_estimator("rloo")
def rloo(x: AdvInputs) -> Tensor:
    """r_i - the mean of the other valid members' rewards (RLOO's leave-one-out baseline), = k/(k-1) (r_i - mean)
    over k valid members: unbiased, as the baseline does not depend on the sample it scores. Needs k >= 2."""
    r, valid = x.rewards, x.valid
    _, _, constant = _group_stats(r, valid)
    count = valid.to(r.dtype).sum(-1, keepdim=True)  # (G, 1)
    total = torch.where(valid, r, torch.zeros_like(r)).sum(-1, keepdim=True)  # (G, 1)
    adv = r - (total - r) / (count - 1.0).clamp(min=1.0)  # (G, n)
    return torch.where(constant | ~valid, torch.zeros_like(adv), adv)


# ------------------------------------------------------------------------------------------------ REINFORCE++
def _returns(seq_reward: Tensor, x: AdvInputs) -> Tensor:
    """(B, T): each masked token's undiscounted return, its sequence's reward (`seq_reward` (G, n), given at the
    last token) plus the per-token rewards of the masked tokens from it on; 0 off the mask. A multi-turn episode's
    env tokens are off the mask: they neither earn nor get anything, and the returns run across them."""
    on = x.mask > 0  # (B, T)
    dtype = torch.promote_types(seq_reward.dtype, x.mask.dtype)
    tok = torch.zeros_like(x.mask, dtype=dtype) if x.token_rewards is None else x.token_rewards.to(dtype)
    tok = torch.where(on, tok, torch.zeros_like(tok))  # (B, T)
    later = tok.flip(-1).cumsum(-1).flip(-1)  # (B, T): sum over s >= t
    ret = later + seq_reward.reshape(-1, 1).to(dtype)  # (B, T)
    return torch.where(on, ret, torch.zeros_like(ret))


def _whiten_over_batch(ret: Tensor, x: AdvInputs) -> Tensor:
    """(ret - mean) / (std + eps) over the masked tokens of the valid rows of every DP rank (sample std), in float64;
    0 elsewhere."""
    counted = (x.mask > 0) & x.valid.reshape(-1, 1)  # (B, T)
    w = counted.to(torch.float64)
    y = ret.to(torch.float64)
    count, total = x.reduce_sum(torch.stack([w.sum(), (y * w).sum()])).unbind()
    mean = total / count.clamp(min=1.0)
    sq = x.reduce_sum(((y - mean) ** 2 * w).sum().reshape(1))[0]
    std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()
    adv = (y - mean) / (std + x.eps)  # (B, T)
    return torch.where(counted, adv, torch.zeros_like(adv)).to(ret.dtype)


@register_adv_estimator("reinforce_pp", per_token=True, group_baseline=False)
def reinforce_pp(x: AdvInputs) -> Tensor:
    """REINFORCE++: the returns of the sequence's reward and the per-token rewards (the KL penalty under
    `algo.kl.mode=reward`), whitened over the batch; no group baseline, so a group whose rewards tie still gets
    advantages (its reward against the batch's)."""
    return _whiten_over_batch(_returns(x.rewards, x), x)


@register_adv_estimator("reinforce_pp_baseline", per_token=True)
def reinforce_pp_baseline(x: AdvInputs) -> Tensor:
    """REINFORCE++-baseline: the group mean reward subtracted first (exactly 0 for a group whose rewards tie), then
    the returns with the per-token rewards, whitened over the batch."""
    mean, _, constant = _group_stats(x.rewards, x.valid)
    centred = torch.where(constant, torch.zeros_like(x.rewards), x.rewards - mean)  # (G, n)
    return _whiten_over_batch(_returns(centred, x), x)


# ------------------------------------------------------------------------------------------------------- GAE
def _gae(x: AdvInputs) -> Tensor:
    """(B, T) raw GAE: A_t = delta_t + gamma lam A_t' and delta_t = r_t + gamma V_t' - V_t, t' the row's next masked
    token (V_t' = A_t' = 0 after its last); 0 off the mask. One loop over T, vectorized over rows; the carried next
    value and advantage pass through unmasked tokens unchanged, which is what skips them."""
    if x.values is None:
        raise ValueError("advantage estimator 'gae' needs a critic's values (critic.enable=true)")
    on = x.mask > 0  # (B, T)
    dtype = torch.promote_types(torch.promote_types(x.rewards.dtype, x.values.dtype), x.mask.dtype)
    values = torch.where(on, x.values.to(dtype), torch.zeros((), dtype=dtype, device=on.device))  # (B, T)
    tok = torch.zeros_like(values) if x.token_rewards is None else x.token_rewards.to(dtype)
    tok = torch.where(on, tok, torch.zeros_like(tok))  # (B, T)
    B, T = on.shape
    cols = torch.arange(T, device=on.device).expand(B, T)
    last = torch.where(on, cols, torch.full_like(cols, -1)).amax(-1, keepdim=True)  # (B, 1): the last masked token
    tok = tok + torch.where(cols == last, x.rewards.reshape(-1, 1).to(dtype), torch.zeros_like(tok))
    adv = torch.zeros_like(values)
    next_value = next_adv = values.new_zeros(B)  # (B,)
    for t in range(T - 1, -1, -1):
        here = on[:, t]
        delta = tok[:, t] + x.gamma * next_value - values[:, t]
        a = delta + x.gamma * x.lam * next_adv
        adv[:, t] = torch.where(here, a, torch.zeros_like(a))
        next_adv = torch.where(here, a, next_adv)
        next_value = torch.where(here, values[:, t], next_value)
    return adv


def gae_returns(rewards: Tensor, mask: Tensor, values: Tensor, token_rewards: Tensor | None = None,
                gamma: float = 1.0, lam: float = 1.0) -> Tensor:
    """(B, T) the critic's targets under gae: the raw (unwhitened) advantages plus the values, 0 off the mask.
    `rewards` (G, n) or (B,); the other arguments as `compute_advantages` takes them."""
    r = rewards.detach().reshape(-1, 1)
    x = AdvInputs(r, torch.ones_like(r, dtype=torch.bool), mask=mask.detach(), values=values.detach(),
                  token_rewards=None if token_rewards is None else token_rewards.detach(), gamma=gamma, lam=lam)
    adv = _gae(x)
    return torch.where(mask > 0, adv + x.values.to(adv.dtype), torch.zeros_like(adv))


@register_adv_estimator("gae", per_token=True, group_baseline=False, uses_values=True)
def gae(x: AdvInputs) -> Tensor:
    """GAE with a critic's values, whitened over the batch (the masked tokens of the valid rows of every DP rank)."""
    return _whiten_over_batch(_gae(x), x)


# ------------------------------------------------------------------------------------------------ entry points
def _estimator(name: str) -> Estimator:
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (algo.adv_estimator); valid: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def _prepare(rewards: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, n) = (prompts, samples per prompt), got shape {tuple(rewards.shape)}")
    r = rewards.detach()
    r = r if r.is_floating_point() else r.to(torch.float32)
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    if valid.shape != r.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must match rewards {tuple(r.shape)}")
    return r, valid


def is_per_token(name: str) -> bool:
    """Whether estimator `name` gives one advantage per token ((B, T)) rather than one per sequence."""
    return _estimator(name).per_token


def uses_values(name: str) -> bool:
    """Whether estimator `name` reads a critic's values."""
    return _estimator(name).uses_values


def compute_advantages(
    name: str, rewards: Tensor, valid: Tensor | None = None, eps: float = 1e-6, *, mask: Tensor | None = None,
    token_rewards: Tensor | None = None, values: Tensor | None = None, reduce_sum: Reduce | None = None,
    gamma: float = 1.0, lam: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """Advantages for rewards (G, n): (G, n) from a group estimator, (G*n, T) from a per-token one; and metrics.

    `valid` (G, n) bool, default all valid. `mask` (G*n, T): the tokens that get advantages (needed by per-token
    estimators). `token_rewards` (G*n, T): per-token rewards (the negated KL penalty); a group estimator sees their
    sum added to the sequence's reward. `reduce_sum`: the DP ranks' sum for batch statistics (default: this rank).
    `values` (G*n, T): a critic's, for an estimator that reads them (gae, with `gamma` and `lam`).
    A group whose valid members all have the same reward gets advantage exactly 0 from a group estimator.
    """
    est = _estimator(name)
    r, valid = _prepare(rewards, valid)
    if mask is not None and mask.shape[0] != r.numel():
        raise ValueError(f"mask {tuple(mask.shape)} must have one row per sample, {r.numel()}")
    if est.per_token and mask is None:
        raise ValueError(f"advantage estimator {name!r} gives one advantage per token: it needs the tokens' mask")
    if token_rewards is not None and not est.per_token:
        r = r + token_rewards.detach().to(r.dtype).sum(-1).view_as(r)
        token_rewards = None
    x = AdvInputs(r, valid, eps, None if mask is None else mask.detach(),
                  None if token_rewards is None else token_rewards.detach(),
                  None if values is None else values.detach(), reduce_sum or _local, gamma, lam)
    adv = est.fn(x)  # (G, n) or (G*n, T)
    return adv, _metrics(adv, r, valid, x.mask if est.per_token else None)


def _metrics(adv: Tensor, r: Tensor, valid: Tensor, mask: Tensor | None) -> dict[str, float]:
    """Over this rank's valid sequences (their masked tokens for per-token advantages)."""
    _, _, constant = _group_stats(r, valid)
    v = valid.to(r.dtype)
    counted = v if mask is None else (mask > 0).to(adv.dtype) * v.reshape(-1, 1)  # like adv
    n = counted.sum().clamp(min=1.0)
    adv_mean = (adv * counted).sum() / n
    metrics = {
        "adv/mean": adv_mean,
        "adv/std": (((adv - adv_mean) ** 2 * counted).sum() / n).sqrt(),
        "adv/abs_max": (adv.abs() * counted).amax() if adv.numel() else r.new_zeros(()),
        "adv/zero_std_group_frac": constant.to(r.dtype).mean() if r.numel() else r.new_zeros(()),
        "adv/valid_frac": v.mean() if r.numel() else r.new_zeros(()),
    }
    return metrics_to_floats(metrics)


def zero_advantage(advantages: Tensor) -> Tensor:
    """(B,) bool: the sequences whose advantage, or every token's for per-token advantages (B, T), is exactly 0."""
    return (advantages == 0).reshape(advantages.shape[0], -1).all(-1)


def reward_signal(name: str, rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """(G, n) bool: the members whose reward alone gives them a learning signal under estimator `name`, judged
    without a KL penalty or a critic. With a group baseline: a valid member whose reward differs from its group's
    mean (the members a group estimator gives a non-zero advantage); without one (reinforce_pp): every valid member,
    whose reward is measured against the batch's."""
    est = _estimator(name)
    r, valid = _prepare(rewards, valid)
    if est.group_baseline:
        return drgrpo(AdvInputs(r, valid)) != 0
    return valid.clone()
