"""The actor's objective for one micro-batch: policy loss x correction weights + KL - entropy bonus.

    loss = agg(pg_tok * weights) + kl_coef * agg(kl_tok [* kl_weights]) - entropy_coef * agg(entropy)

where agg is `aggregation.aggregate(cfg.loss_agg, ., mask, norm)` with global minibatch counts, so the
losses of all micro-batches on all ranks add up to the minibatch loss (see aggregation.py). For a loss whose ratio
is one per sequence (GSPO, `policy_loss.SEQUENCE_RATIO`) `weights` is one per sequence too: the geometric mean of
the token weights over the sequence's loss tokens, the same length-normalized form as its ratio (docs/correction.md).

Metrics are python floats of two kinds:
  * additive terms, "actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy": this micro-batch's share;
    summing them over micro-batches and ranks gives the minibatch value (with loss_agg="token",
    "actor/entropy" then is the global per-token mean entropy);
  * ratio statistics, "actor/clip_frac", "actor/clip_frac_low", "actor/clip_frac_high",
    "actor/ratio_mean", "actor/approx_kl" (and "actor/dual_clip_frac"): masked means over this
    micro-batch; average them.

Left out on purpose: value/critic losses, and a KL term in the reward beyond the simple per-token
penalty of `kl_reward_penalty`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.algo.aggregation import LOSS_AGG, Normalizer, aggregate, masked_mean, metrics_to_floats
from sparserl.algo.kl import KL_ESTIMATORS, kl_estimate
from sparserl.algo.policy_loss import POLICY_LOSSES, SEQUENCE_RATIO


@dataclass
class LossConfig:
    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's clip-higher
    dual_clip: float | None = None
    loss_agg: str = "token"  # "token" | "sequence"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "loss"  # "loss": KL term in the objective | "reward": per-token penalty on rewards
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        for key, registry in (("policy_loss", POLICY_LOSSES), ("loss_agg", LOSS_AGG), ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, key) not in registry:
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} is not one of {sorted(registry)}")
        if self.kl_mode not in ("loss", "reward"):
            raise ValueError(f"LossConfig.kl_mode must be 'loss' or 'reward', got {self.kl_mode!r}")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(
                f"LossConfig.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )


def policy_objective(
    cfg: LossConfig,
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    norm: Normalizer,
    weights: Tensor | None = None,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    kl_weights: Tensor | None = None,
    host_metrics: bool = True,
) -> tuple[Tensor, dict[str, float | Tensor]]:
    """Scalar loss for one micro-batch. Per-token inputs are (B, T); adv is (B, T) or (B, 1).

    `weights` / `kl_weights` are the detached correction weights (1.0 off-mask); `mask` is the
    corrected loss mask. `logp_ref` is required when kl_mode="loss" and kl_coef != 0; when given
    otherwise, the KL is only reported. Metrics come back as python floats (one device sync), or with
    `host_metrics=False` as detached 0-dim tensors on the loss's device, for a caller that sums them there and
    reads them once per step (the actor's micro-batch loop).
    """
    pg_tok, pg_metrics = POLICY_LOSSES[cfg.policy_loss](
        logp, logp_old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip
    )  # (B, T)
    if weights is not None:
        w = weights.detach()
        pg_tok = pg_tok * (sequence_geometric_mean(w, mask) if cfg.policy_loss in SEQUENCE_RATIO else w)
    pg_loss = aggregate(cfg.loss_agg, pg_tok, mask, norm)
    loss = pg_loss
    terms = {"actor/pg_loss": pg_loss.detach()}

    kl_in_loss = cfg.kl_mode == "loss" and cfg.kl_coef != 0.0
    if kl_in_loss and logp_ref is None:
        raise ValueError("policy_objective: kl_coef != 0 with kl_mode='loss' needs logp_ref")
    if logp_ref is not None:
        kl_tok = kl_estimate(cfg.kl_estimator, logp, logp_ref)  # (B, T)
        if kl_weights is not None:
            kl_tok = kl_tok * kl_weights.detach()
        kl = aggregate(cfg.loss_agg, kl_tok, mask, norm)
        if kl_in_loss:
            loss = loss + cfg.kl_coef * kl
        terms["actor/kl"] = kl.detach()

    if entropy is not None:
        ent = aggregate(cfg.loss_agg, entropy, mask, norm)
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * ent
        terms["actor/entropy"] = ent.detach()

    terms["actor/loss"] = loss.detach()
    terms.update({f"actor/{k}": v for k, v in pg_metrics.items()})
    if not host_metrics:
        return loss, {k: v.detach() if isinstance(v, Tensor) else v for k, v in terms.items()}
    return loss, _to_floats(terms)


def sequence_geometric_mean(weights: Tensor, mask: Tensor) -> Tensor:
    """(B, 1): exp(mean of log w over each sequence's loss tokens); 1 for a sequence without any. The correction's
    weights are positive on the mask (xi >= e^-20), so the log is finite there."""
    on = mask > 0  # (B, T)
    logw = torch.where(on, weights.log(), torch.zeros_like(weights))  # (B, T)
    return torch.exp(logw.sum(-1, keepdim=True) / on.sum(-1, keepdim=True).clamp(min=1).to(weights.dtype))


def _to_floats(terms: dict[str, Tensor | float]) -> dict[str, float]:
    """The tensors among `terms` read back in one device sync; floats pass through."""
    keys = [k for k, v in terms.items() if isinstance(v, Tensor)]
    values = dict(zip(keys, torch.stack([terms[k].detach().to(torch.float64).reshape(()) for k in keys]).tolist())) \
        if keys else {}
    return {k: values.get(k, v) for k, v in terms.items()}


def kl_reward_penalty(
    cfg: LossConfig, logp_old: Tensor, logp_ref: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """For kl_mode="reward": the per-token penalty kl_coef * KL(old || ref), (B, T), 0 off-mask.

    The caller subtracts it from the rewards (e.g. its per-sequence sum from a sequence reward) before
    computing advantages. Computed without grad: it is part of the reward, not of the objective.
    """
    with torch.no_grad():
        kl_tok = kl_estimate(cfg.kl_estimator, logp_old.detach(), logp_ref.detach())  # (B, T)
        kl_tok = torch.where(mask > 0, kl_tok * mask, torch.zeros_like(kl_tok))
        penalty = cfg.kl_coef * kl_tok  # (B, T)
        metrics = {"reward/kl": masked_mean(kl_tok, mask), "reward/kl_penalty": masked_mean(penalty, mask)}
    return penalty, metrics_to_floats(metrics)
