"""Per-token policy-gradient losses, registered by name (`algo.policy_loss`).

Every loss takes the learner's log-probs `logp` (B, T) with grad, the dense old policy's `logp_old`
(B, T), advantages (B, T) or (B, 1), and the loss mask (B, T); it returns the per-token loss (B, T),
unreduced and unweighted (aggregation and correction weights are applied by `loss.policy_objective`),
plus metrics: masked means over this call, as 0-dim tensors on the loss's device (python floats are accepted
too), read back by `loss.policy_objective` in one copy with its own, or not at all where the caller sums them on
the device.

The PPO ratio is always taken against the *dense* old policy; the sparse sampler enters only through
the detached correction weights (the decoupled objective: sampler -> old policy by importance weights,
old policy -> learner by the clipped ratio). GSPO's ratio is one per sequence (`SEQUENCE_RATIO`): the correction's
token weights then enter as one per sequence too, their geometric mean (`loss.policy_objective`).

Left out on purpose: SAPO, clip-cov / KL-cov and the other verl variants; each is one registered function when
a run needs it.
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
# Losses whose ratio is one per sequence (GSPO): a per-token importance weight of the correction is turned into one
# per sequence before it multiplies the loss (`loss.policy_objective`).
SEQUENCE_RATIO: set[str] = set()


def register_policy_loss(name: str, *, vanishes_at_zero_advantage: bool = False,
                         sequence_ratio: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        if vanishes_at_zero_advantage:
            VANISH_AT_ZERO_ADVANTAGE.add(name)
        if sequence_ratio:
            SEQUENCE_RATIO.add(name)
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


# ------------------------------------------------------------------------------------------------------ GSPO
def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(B, 1): the mean of the (clamped) token log-ratios over each sequence's loss tokens; 0 without any."""
    on = mask > 0  # (B, T)
    total = torch.where(on, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)  # (B, 1)
    return total / on.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)


def _sequence_advantage(adv: Tensor, mask: Tensor) -> Tensor:
    """(B, 1): one advantage per sequence; per-token advantages (B, T) by their mean over the loss tokens."""
    if adv.shape[-1] == 1:
        return adv
    on = mask > 0
    total = torch.where(on, adv, torch.zeros_like(adv)).sum(-1, keepdim=True)
    return total / on.sum(-1, keepdim=True).clamp(min=1).to(adv.dtype)


def _no_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip is a PPO option; set it to None with policy_loss={name!r}")


def _clip_metrics(ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float) -> dict[str, Tensor]:
    """Shares of the loss tokens whose (sequence) ratio sits on a clipped branch that passes no gradient."""
    high = ((adv > 0) & (ratio > 1.0 + clip_high)).to(mask.dtype)
    low = ((adv < 0) & (ratio < 1.0 - clip_low)).to(mask.dtype)
    high, low = high.expand_as(mask), low.expand_as(mask)
    return {"clip_frac": masked_mean(high + low, mask), "clip_frac_low": masked_mean(low, mask),
            "clip_frac_high": masked_mean(high, mask)}


@register_policy_loss("gspo", vanishes_at_zero_advantage=True, sequence_ratio=True)
def gspo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Qwen3's): the sequence ratio s = exp(mean over the loss tokens of log(pi / pi_old)), the geometric mean of
    the token ratios, clipped to [1 - clip_low, 1 + clip_high]: max(-A s, -A clip(s)) per sequence, on each of its
    loss tokens, so `algo.loss_agg=sequence` gives the paper's mean over sequences and `token` weighs a sequence by
    its length. Each token of a sequence gets the gradient -A s (unclipped), whatever the sequence's length.

    One advantage per sequence: per-token advantages (B, T) enter as their mean over the loss tokens (the same
    value for every estimator whose advantages are constant over a sequence; use gspo_token otherwise).
    `dual_clip` does not apply and must be None.
    """
    _no_dual_clip("gspo", dual_clip)
    log_ratio, ratio = _ratio(logp, logp_old.detach())  # (B, T)
    s = torch.exp(_sequence_log_ratio(log_ratio, mask))  # (B, 1)
    a = _sequence_advantage(adv.detach(), mask)  # (B, 1)
    per_seq = torch.maximum(-a * s, -a * s.clamp(1.0 - clip_low, 1.0 + clip_high))  # (B, 1)
    loss = per_seq.expand_as(logp)  # (B, T)
    with torch.no_grad():
        metrics = {**_clip_metrics(s.detach(), a, mask, clip_low, clip_high), **_ratio_metrics(log_ratio, ratio, mask)}
    return loss, metrics


@register_policy_loss("gspo_token", vanishes_at_zero_advantage=True)
def gspo_token(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: s_t = sg[s] * pi_t / sg[pi_t], whose value is the sequence ratio s and whose gradient is a token's
    own ratio's times s; loss max(-A_t s_t, -A_t clip(s_t)) per token. With one advantage per sequence it has the
    value and the gradient of `gspo`; it also takes per-token advantages (REINFORCE++ with the KL in the reward),
    and the correction's token weights multiply its per-token terms as they are. `dual_clip` must be None.
    """
    _no_dual_clip("gspo_token", dual_clip)
    log_ratio, ratio = _ratio(logp, logp_old.detach())  # (B, T)
    seq = _sequence_log_ratio(log_ratio, mask).detach()  # (B, 1)
    own = torch.where(mask > 0, logp - logp.detach(), torch.zeros_like(logp))  # (B, T): value 0, gradient 1
    s_tok = torch.exp(seq + own)  # (B, T)
    adv = adv.detach().expand_as(logp)  # (B, T)
    loss = torch.maximum(-adv * s_tok, -adv * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high))  # (B, T)
    with torch.no_grad():
        metrics = {**_clip_metrics(s_tok.detach(), adv, mask, clip_low, clip_high),
                   **_ratio_metrics(log_ratio, ratio, mask)}
    return loss, metrics
