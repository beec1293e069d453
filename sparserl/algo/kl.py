"""Per-token estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi (Schulman's k1/k2/k3).

With d = logp - logp_ref (clamped to +-20 before any exp):
    k1 = d                      unbiased, can be negative, high variance
    k2 = d^2 / 2                biased, low variance, >= 0 ("mse")
    k3 = exp(-d) + d - 1        unbiased, low variance, >= 0 ("low_var_kl", the GRPO default)

Each maps (logp, logp_ref) of shape (B, T) to (B, T). Gradients flow through `logp` only.

Left out on purpose: the straight-through "k3+" (k3 value, k2 gradient), `abs`, and clamping the k3
*value* (verl clips it to +-10); the log-ratio clamp already keeps it finite.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0

KlEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: dict[str, KlEstimator] = {}


def register_kl_estimator(*names: str) -> Callable[[KlEstimator], KlEstimator]:
    def deco(fn: KlEstimator) -> KlEstimator:
        for name in names:
            if name in KL_ESTIMATORS:
                raise ValueError(f"KL estimator {name!r} is already registered")
            KL_ESTIMATORS[name] = fn
        return fn

    return deco


def _log_ratio(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return (logp - logp_ref.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)


@register_kl_estimator("k1", "kl")
def k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return _log_ratio(logp, logp_ref)


@register_kl_estimator("k2", "mse")
def k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return 0.5 * _log_ratio(logp, logp_ref) ** 2


@register_kl_estimator("k3", "low_var_kl")
def k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    d = _log_ratio(logp, logp_ref)  # (B, T)
    return torch.exp(-d) + d - 1.0


def kl_estimate(name: str, logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token KL estimate (B, T) with the estimator registered as `name`."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r} (algo.kl.estimator); valid: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name](logp, logp_ref)
