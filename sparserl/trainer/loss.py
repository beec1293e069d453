"""The config adapters between `algo.*` settings and the pure math of sparserl/algo, and the loss closure of
`Actor.update` on the separate-pass path.

- `loss_config`: `algo.*` -> `LossConfig` (policy loss, clipping, aggregation, KL, entropy).
- `apply_correction`: the correction (`algo.correction`, a `CorrectionConfig`) run on a batch whose logp_old is
  known (it sets the batch's weights and mask under `mode=apply`).
- `make_loss_fn`: the loss closure over a batch whose logp_old, weights and masks are already set; it only
  slices them to the micro-batch. The single-update path has its own (trainer/old_logprobs.py).

Left out on purpose: a loss registry of its own (policy losses, aggregations and KL estimators are registered
in sparserl/algo) and any state in the closure (it is the same function for every step).
"""
from __future__ import annotations


import torch

from sparserl.actor.actor import LossFn, TrainBatch
from sparserl.algo.correction import correct, dist_reduce_sum
from sparserl.algo.loss import LossConfig, policy_objective
from sparserl.config import AlgoConfig


def loss_config(algo: AlgoConfig) -> LossConfig:
    return LossConfig(policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                      loss_agg=algo.loss_agg, kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, kl_mode=algo.kl.mode,
                      entropy_coef=algo.entropy_coef)


def apply_correction(algo: AlgoConfig, batch: TrainBatch, dp_group) -> tuple[torch.Tensor, dict]:
    """Sets the batch's correction weights and mask; returns which sequences were rejected (B,) and metrics."""
    cfg = algo.correction
    corr, metrics = correct(cfg, batch.logp_old, batch.logp_sparse, batch.mask, reduce_sum=dist_reduce_sum(dp_group))
    if cfg.enable and cfg.mode == "apply":
        batch.weights, batch.mask, batch.kl_weights = corr.weights, corr.mask, corr.kl_weights
    return corr.seq_rejected, metrics


def make_loss_fn(cfg: LossConfig) -> LossFn:
    def loss_fn(logp, entropy, batch: TrainBatch, idx, norm):
        T = logp.shape[1]
        take = lambda t: None if t is None else t[idx, :T]  # noqa: E731
        use_kl = cfg.kl_coef != 0 and cfg.kl_mode == "loss"
        return policy_objective(
            cfg, logp, take(batch.logp_old), batch.advantages[idx][:, None], take(batch.mask), norm,
            weights=take(batch.weights), logp_ref=take(batch.logp_ref) if use_kl else None,
            entropy=entropy, kl_weights=take(batch.kl_weights) if use_kl else None,
        )

    return loss_fn
