"""Pure tensor math for the RL objective: advantages, policy losses, KL estimators, loss aggregation,
the sparse-rollout correction and the overlong penalty and mask. Imports torch (and torch.distributed for the
optional all-reduce) only; no model, engine or config code lives here.

`CorrectionConfig` (sparserl/algo/correction_config.py) imports no torch, so the run's config can use it without
torch; every other name loads its module on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from sparserl.algo.correction_config import CorrectionConfig

_MODULES = {
    "sparserl.algo.advantages": ("ADV_ESTIMATORS", "compute_advantages", "register_adv_estimator"),
    "sparserl.algo.aggregation": ("LOSS_AGG", "Normalizer", "aggregate", "count_normalizer", "masked_mean",
                                  "register_loss_agg"),
    "sparserl.algo.correction": ("Correction", "DistReduceSum", "correct", "dist_reduce_sum"),
    "sparserl.algo.kl": ("KL_ESTIMATORS", "kl_estimate", "register_kl_estimator"),
    "sparserl.algo.loss": ("LossConfig", "kl_reward_penalty", "policy_objective"),
    "sparserl.algo.overlong": ("mask_truncated", "overlong_penalty", "overlong_ramp"),
    "sparserl.algo.policy_loss": ("POLICY_LOSSES", "ppo_clip", "register_policy_loss"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "ADV_ESTIMATORS", "compute_advantages", "register_adv_estimator",
    "LOSS_AGG", "Normalizer", "aggregate", "count_normalizer", "masked_mean", "register_loss_agg",
    "Correction", "CorrectionConfig", "DistReduceSum", "correct", "dist_reduce_sum",
    "KL_ESTIMATORS", "kl_estimate", "register_kl_estimator",
    "LossConfig", "kl_reward_penalty", "policy_objective",
    "mask_truncated", "overlong_penalty", "overlong_ramp",
    "POLICY_LOSSES", "ppo_clip", "register_policy_loss",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
