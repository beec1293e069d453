"""The config adapters between `algo.*` settings and the pure math of sparserl/algo, and the loss closure of
`Actor.update` on the separate-pass path.

- `loss_config`: `algo.*` -> `LossConfig` (policy loss, clipping, aggregation, KL, entropy).
- `apply_correction`: the correction (`algo.correction`, a `CorrectionConfig`) run on a batch whose logp_old is
  known (it sets the batch's weights and mask under `mode=apply`).
- `zero_advantage_no_grad`: whether the actor may skip backward over zero-advantage sequences.
- `make_loss_fn`: the loss closure over a batch whose logp_old, weights and masks are already set; it only
  slices them to the micro-batch. The fused path has its own (trainer/loss_path.py).
- `advantage_rows`: a micro-batch's advantages as the policy loss takes them, (b, 1) or (b, T).

Left out on purpose: a loss registry of its own (policy losses, aggregations and KL estimators are registered
in sparserl/algo) and any state in the closure (it is the same function for every step).
"""
from __future__ import annotations


import torch

from sparserl.actor.actor import LossFn, TrainBatch
from sparserl.algo.correction import correct, dist_reduce_sum
from sparserl.algo.loss import LossConfig, policy_objective
from sparserl.algo.policy_loss import VANISH_AT_ZERO_ADVANTAGE
from sparserl.config import AlgoConfig, Config


def loss_config(algo: AlgoConfig) -> LossConfig:
    return LossConfig(policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                      loss_agg=algo.loss_agg, kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, kl_mode=algo.kl.mode,
                      entropy_coef=algo.entropy_coef)


def zero_advantage_no_grad(cfg: Config) -> tuple[bool, str]:
    """Whether a sequence with a zero advantage adds exactly nothing to the update's gradient, so the actor may run
    its forward without autograd (logp_old and the metrics still see it) and skip it in backward; if not, why.

    The policy term is the advantage times a finite factor (the log-ratio is clamped) for the registered losses
    in `VANISH_AT_ZERO_ADVANTAGE`, whatever the correction's weights and masks; a KL term in the loss, an entropy
    bonus and adapter dropout (which draws random numbers per forward) are what else a sequence can bring.
    """
    a, algo = cfg.actor, cfg.algo
    if not a.skip_zero_advantage:
        return False, "actor.skip_zero_advantage=false"
    if algo.policy_loss not in VANISH_AT_ZERO_ADVANTAGE:
        return False, f"algo.policy_loss={algo.policy_loss} is not registered as 0 at a zero advantage"
    if algo.kl.coef != 0 and algo.kl.mode == "loss":
        return False, "the KL term in the loss (algo.kl.mode=loss) has a gradient at a zero advantage"
    if algo.entropy_coef != 0:
        return False, "the entropy bonus (algo.entropy_coef) has a gradient at a zero advantage"
    if a.lora.rank > 0 and a.lora.dropout > 0:
        return False, "adapter dropout (actor.lora.dropout) draws random numbers in every forward"
    return True, ""


def apply_correction(algo: AlgoConfig, batch: TrainBatch, dp_group) -> tuple[torch.Tensor, dict]:
    """Sets the batch's correction weights and mask; returns which sequences were rejected (B,) and metrics."""
    cfg = algo.correction
    corr, metrics = correct(cfg, batch.logp_old, batch.logp_sparse, batch.mask, reduce_sum=dist_reduce_sum(dp_group))
    if cfg.enable and cfg.mode == "apply":
        batch.weights, batch.mask, batch.kl_weights = corr.weights, corr.mask, corr.kl_weights
    return corr.seq_rejected, metrics


def advantage_rows(advantages: torch.Tensor, idx, T: int) -> torch.Tensor:
    """Rows `idx` of the batch's advantages: (b, 1) from one per sequence, (b, T) from one per token."""
    rows = advantages[idx]
    return rows[:, :T] if rows.dim() == 2 else rows[:, None]


def make_loss_fn(cfg: LossConfig) -> LossFn:
    def loss_fn(logp, entropy, batch: TrainBatch, idx, norm):
        T = logp.shape[1]
        take = lambda t: None if t is None else t[idx, :T]  # noqa: E731
        use_kl = cfg.kl_coef != 0 and cfg.kl_mode == "loss"
        return policy_objective(
            cfg, logp, take(batch.logp_old), advantage_rows(batch.advantages, idx, T), take(batch.mask), norm,
            weights=take(batch.weights), logp_ref=take(batch.logp_ref) if use_kl else None,
            entropy=entropy, kl_weights=take(batch.kl_weights) if use_kl else None, host_metrics=False,
        )

    return loss_fn
