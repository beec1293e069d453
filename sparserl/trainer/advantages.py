"""Group advantages of one step's batch: rewards (minus the KL penalty under `algo.kl.mode=reward`) through the
configured estimator (algo/advantages.py), one group per prompt's `rollout.n` samples.

`set_advantages` also decides which sequences count in the group baseline: all of them (the paper, and
`algo.correction.rejected_in_baseline=true`), or only those the correction kept. Where logp_old is known before
the update (the separate-pass path) it also logs `mismatch/low_xi_*`; the single-update path logs them from the
update (trainer/old_logprobs.py).

Left out on purpose: dynamic sampling (dropping groups whose rewards have zero variance) and partial rollouts.
"""
from __future__ import annotations

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.algo.advantages import compute_advantages
from sparserl.algo.correction import dist_reduce_sum, low_xi_metrics
from sparserl.algo.loss import LossConfig, kl_reward_penalty
from sparserl.config import AlgoConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.train_batch import pad


def set_advantages(algo: AlgoConfig, batch: TrainBatch, samples: list[Sample], n: int, rejected: torch.Tensor | None,
                   loss_cfg: LossConfig, dp_group=None) -> dict:
    """Sets `batch.advantages` (B,); returns the metrics.

    `rejected` (B,) is None on the single-update path, which is never taken when advantages depend on it.
    Where logp_old is already known (the separate-pass path), also the `mismatch/low_xi_*` metrics, on the
    samples' own response masks (batch.mask may be the corrected one by now); the single-update path logs
    them from `FusedOldLogprobLoss.finalize`.
    """
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=batch.mask.device)
    metrics: dict[str, float] = {}
    if loss_cfg.kl_coef and loss_cfg.kl_mode == "reward":
        penalty, m = kl_reward_penalty(loss_cfg, batch.logp_old, batch.logp_ref, batch.mask)
        rewards = rewards - penalty.sum(-1)
        metrics.update(m)
    valid = None
    if algo.correction.enable and algo.correction.mode == "apply" and not algo.correction.rejected_in_baseline:
        assert rejected is not None, "rejected_in_baseline=False needs the correction before the update"
        valid = (~rejected).view(-1, n)
    adv, m = compute_advantages(algo.adv_estimator, rewards.view(-1, n), valid)
    batch.advantages = adv.reshape(-1)
    metrics.update(m)
    if batch.logp_old is not None:
        response_mask = pad([s.loss_mask for s in samples], batch.mask.shape[1], batch.mask.device)
        metrics.update(low_xi_metrics(batch.logp_old, batch.logp_sparse, response_mask, batch.advantages,
                                      dist_reduce_sum(dp_group)))
    return metrics
