"""Pure tensor math for the RL objective: advantages, policy losses, KL estimators, loss aggregation,
and the sparse-rollout correction. Imports torch (and torch.distributed for the optional all-reduce)
only; no model, engine or config code lives here.
"""
from sparserl.algo.advantages import ADV_ESTIMATORS, compute_advantages, register_adv_estimator
from sparserl.algo.aggregation import LOSS_AGG, Normalizer, aggregate, count_normalizer, masked_mean, register_loss_agg
from sparserl.algo.correction import (
    Correction,
    CorrectionConfig,
    DistReduceSum,
    correct,
    dist_reduce_max,
    dist_reduce_sum,
)
from sparserl.algo.kl import KL_ESTIMATORS, kl_estimate, register_kl_estimator
from sparserl.algo.loss import LossConfig, kl_reward_penalty, policy_objective
from sparserl.algo.policy_loss import POLICY_LOSSES, ppo_clip, register_policy_loss

__all__ = [
    "ADV_ESTIMATORS", "compute_advantages", "register_adv_estimator",
    "LOSS_AGG", "Normalizer", "aggregate", "count_normalizer", "masked_mean", "register_loss_agg",
    "Correction", "CorrectionConfig", "DistReduceSum", "correct", "dist_reduce_max", "dist_reduce_sum",
    "KL_ESTIMATORS", "kl_estimate", "register_kl_estimator",
    "LossConfig", "kl_reward_penalty", "policy_objective",
    "POLICY_LOSSES", "ppo_clip", "register_policy_loss",
]
