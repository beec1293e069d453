"""Per-token policy-gradient losses, registered by name (`algo.policy_loss`).

Every loss takes the learner's log-probs `logp` (B, T) with grad, the dense old policy's `logp_old`
(B, T), advantages (B, T) or (B, 1), and the loss mask (B, T); it returns the per-token loss (B, T),
unreduced and unweighted (aggregation and correction weights are applied by `loss.policy_objective`),
plus metrics: masked means over this call, as 0-dim tensors on the loss's device (python floats are accepted
too), read back by `loss.policy_objective` in one copy with its own, or not at all where the caller sums them on
the device.

The PPO ratio is always taken against the *dense* old policy; the sparse sampler enters only through
the detached correction weights (the decoupled objective: sampler -> old policy by importance weights,
old policy -> learner by the clipped ratio).

Left out on purpose: GSPO (sequence-level ratios), SAPO, clip-cov / KL-cov and the other verl variants;
each is one registered function when a run needs it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from sparserl.algo.aggregation import masked_mean

LOG_RATIO_CLAMP = 20.0

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor | float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
# Losses whose every token is 0, with a zero gradient, where the advantage is 0 (the loss is the advantage times a
# finite factor): the actor may skip backward over such sequences (`actor.skip_zero_advantage`).
VANISH_AT_ZERO_ADVANTAGE: set[str] = set()


def register_policy_loss(name: str, *, vanishes_at_zero_advantage: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        if vanishes_at_zero_advantage:
            VANISH_AT_ZERO_ADVANTAGE.add(name)
        return fn

    return deco


def _ratio(logp: Tensor, logp_old: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = (logp - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    return log_ratio, torch.exp(log_ratio)


def _ratio_metrics(log_ratio: Tensor, ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    lr, r = log_ratio.detach(), ratio.detach()
    return {
        "ratio_mean": masked_mean(r, mask),
        # k3 estimate of KL(old || new): non-negative and low variance.
        "approx_kl": masked_mean(r - 1.0 - lr, mask),
    }


@register_policy_loss("ppo", vanishes_at_zero_advantage=True)
def ppo_clip(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    `clip_high > clip_low` is DAPO's clip-higher. `dual_clip = c > 1` bounds the loss of negative-advantage
    tokens by -A c, so one token whose ratio exploded cannot dominate the update.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    adv = adv.detach().expand_as(logp)  # (B, T)
    log_ratio, ratio = _ratio(logp, logp_old.detach())  # (B, T)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T)

    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1.0 + clip_high)  # clipped branch active: no gradient
        low = (adv < 0) & (r < 1.0 - clip_low)
        metrics = {
            "clip_frac": masked_mean((high | low).to(loss.dtype), mask),
            "clip_frac_low": masked_mean(low.to(loss.dtype), mask),
            "clip_frac_high": masked_mean(high.to(loss.dtype), mask),
            **_ratio_metrics(log_ratio, ratio, mask),
        }

    if dual_clip is not None:
        bound = -adv * dual_clip  # (B, T); positive where adv < 0
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        metrics["dual_clip_frac"] = masked_mean(dual.to(loss.dtype), mask)
    return loss, metrics


@register_policy_loss("cispo", vanishes_at_zero_advantage=True)
def cispo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp.

    The ratio is clipped but detached, so clipped tokens still pass a (bounded) gradient instead of none.
    `dual_clip` does not apply and must be None.
    """
    if dual_clip is not None:
        raise ValueError("dual_clip is a PPO option; set it to None with policy_loss='cispo'")
    adv = adv.detach().expand_as(logp)  # (B, T)
    log_ratio, ratio = _ratio(logp, logp_old.detach())  # (B, T)
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss = -weight * adv * logp  # (B, T)
    with torch.no_grad():
        r = ratio.detach()
        high, low = r > 1.0 + clip_high, r < 1.0 - clip_low
        metrics = {
            "clip_frac": masked_mean((high | low).to(loss.dtype), mask),
            "clip_frac_low": masked_mean(low.to(loss.dtype), mask),
            "clip_frac_high": masked_mean(high.to(loss.dtype), mask),
            **_ratio_metrics(log_ratio, ratio, mask),
        }
    return loss, metrics
