"""Advantages of one step's batch: rewards (minus DAPO's overlong penalty under `algo.overlong.penalty > 0`,
and the KL penalty under `algo.kl.mode=reward`) through the configured estimator (algo/advantages.py), one group
per prompt's `rollout.n` samples. A group estimator gives `batch.advantages` (B,), one per sequence, with the KL
penalty summed into the sequence's reward; a per-token one (REINFORCE++, GAE) gives (B, T), with the KL penalty as
each token's reward and statistics over the loss tokens of every DP rank (`batch.mask` at this point: with the
correction applied, its rejected sequences and masked tokens are out of them). GAE reads the critic's values
(`batch.values`, trainer/critic.py) and also sets the critic's targets, `batch.returns`.

`shaped_rewards` is the reward the advantages see before the KL penalty: the env's reward minus the overlong
ramp of the sample's last model turn (the turn the length cap can cut; algo/overlong.py). Dynamic sampling
filters groups on the same rewards (trainer/dynamic_sampling.py). A sample cut by a length limit and left out
of the loss (`algo.overlong.mask`, trainer/train_batch.py) still counts in its group's baseline here.

`set_advantages` also decides which sequences count in the group baseline: all of them (the paper, and
`algo.correction.rejected_in_baseline=true`), or only those the correction kept. Where logp_old is known before
the update (the separate-pass path) it also logs `mismatch/low_xi_*`; the fused path logs them from the
update (trainer/loss_path.py).

Left out on purpose: partial rollouts, and filtering groups here: dynamic sampling drops the groups without
signal before the batch exists (trainer/dynamic_sampling.py), so every group that reaches this point trains.
"""
from __future__ import annotations

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.algo.advantages import compute_advantages, gae_returns, is_per_token, uses_values
from sparserl.algo.correction import dist_reduce_sum, low_xi_metrics
from sparserl.algo.loss import LossConfig, kl_reward_penalty
from sparserl.algo.overlong import overlong_penalty
from sparserl.config import AlgoConfig
from sparserl.rollout.episode import Sample, cut_by_length, last_turn_len
from sparserl.trainer.train_batch import pad


def shaped_rewards(algo: AlgoConfig, samples: list[Sample], max_new_tokens: int | None,
                   device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards (B,), overlong penalties (B,)): the env's rewards minus the penalties (zeros when it is off)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device)
    o = algo.overlong
    if o.penalty == 0:
        return rewards, torch.zeros_like(rewards)
    if max_new_tokens is None:
        raise ValueError("algo.overlong.penalty > 0 needs rollout.max_new_tokens (the length cap it ramps up to)")
    lengths = torch.tensor([last_turn_len(s) for s in samples], dtype=torch.float32, device=device)
    penalty = overlong_penalty(lengths, max_new_tokens, o.buffer, o.penalty)
    return rewards - penalty, penalty


def overlong_metrics(algo: AlgoConfig, samples: list[Sample], penalty: torch.Tensor, dp_group=None) -> dict[str, float]:
    """`overlong/masked_frac` and `overlong/penalty_mean` over the step's trained samples on every DP rank."""
    o = algo.overlong
    if not o.mask and o.penalty == 0:
        return {}
    local = torch.tensor([float(len(samples)), float(sum(map(cut_by_length, samples))), float(penalty.sum())],
                         dtype=torch.float64, device=penalty.device)
    count, cut, total = dist_reduce_sum(dp_group)(local).tolist()
    out = {}
    if o.mask:
        out["overlong/masked_frac"] = cut / max(count, 1.0)
    if o.penalty:
        out["overlong/penalty_mean"] = total / max(count, 1.0)
    return out


def set_advantages(algo: AlgoConfig, batch: TrainBatch, samples: list[Sample], n: int, rejected: torch.Tensor | None,
                   loss_cfg: LossConfig, dp_group=None, max_new_tokens: int | None = None) -> dict:
    """Sets `batch.advantages`, (B,) or (B, T) by the estimator; returns the metrics.

    `rejected` (B,) is None on the fused path, which is never taken when advantages depend on it.
    Where logp_old is already known (the separate-pass path), also the `mismatch/low_xi_*` metrics, on the
    samples' own response masks (batch.mask may be the corrected one by now); the fused path logs
    them from `FusedOldLogprobLoss.finalize`. `max_new_tokens`: the length cap of the overlong penalty.
    """
    rewards, penalty = shaped_rewards(algo, samples, max_new_tokens, batch.mask.device)
    metrics: dict[str, float] = overlong_metrics(algo, samples, penalty, dp_group)
    token_rewards = None
    if loss_cfg.kl_coef and loss_cfg.kl_mode == "reward":
        penalty, m = kl_reward_penalty(loss_cfg, batch.logp_old, batch.logp_ref, batch.mask)
        token_rewards = -penalty  # (B, T); a group estimator sums it into the sequence's reward
        metrics.update(m)
    valid = None
    if algo.correction.enable and algo.correction.mode == "apply" and not algo.correction.rejected_in_baseline:
        assert rejected is not None, "rejected_in_baseline=False needs the correction before the update"
        valid = (~rejected).view(-1, n)
    per_token = is_per_token(algo.adv_estimator)
    values = batch.values if uses_values(algo.adv_estimator) else None
    adv, m = compute_advantages(algo.adv_estimator, rewards.view(-1, n), valid, mask=batch.mask if per_token else None,
                                token_rewards=token_rewards, values=values, reduce_sum=dist_reduce_sum(dp_group),
                                gamma=algo.gamma, lam=algo.lam)
    if values is not None:
        batch.returns = gae_returns(rewards, batch.mask, values, token_rewards, algo.gamma, algo.lam)
    batch.advantages = adv if per_token else adv.reshape(-1)
    metrics.update(m)
    if batch.logp_old is not None:
        response_mask = batch.response_mask
        if response_mask is None:
            response_mask = pad([s.loss_mask for s in samples], batch.mask.shape[1], batch.mask.device)
        metrics.update(low_xi_metrics(batch.logp_old, batch.logp_sparse, response_mask, batch.advantages,
                                      dist_reduce_sum(dp_group)))
    return metrics
