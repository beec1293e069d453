"""From rollout samples to the tensors of one update: padding, advantages, correction, the loss closure.

Pure functions over this rank's samples plus the all-reduces that make normalizers global, and
`balance_ranks`, which moves sequences between DP ranks before the update. The trainer calls them in
order; each returns its metrics. Left out on purpose: dynamic sampling (dropping groups
whose rewards have zero variance) and partial rollouts.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.actor.logprobs import prompt_key
from sparserl.algo.advantages import compute_advantages
from sparserl.algo.aggregation import Normalizer
from sparserl.algo.correction import CorrectionConfig, correct, dist_reduce_sum, low_xi_metrics, token_decisions
from sparserl.algo.loss import LossConfig, kl_reward_penalty, policy_objective
from sparserl.config import AlgoConfig, Config
from sparserl.data.packing import balanced_partition, contiguous_minibatches, prompt_units
from sparserl.rollout.worker import Sample


def pad(rows: list[list[float]], T: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def to_train_batch(samples: list[Sample], device) -> TrainBatch:
    """The batch with the sampler's log-probs; advantages unset, no dense log-probs yet."""
    T = max(1, max(len(s.response_ids) for s in samples))
    return TrainBatch(
        ids=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        mask=pad([s.loss_mask for s in samples], T, device),
        advantages=torch.zeros(len(samples), device=device),
        logp_sparse=pad([s.logp_sparse for s in samples], T, device),
    )


def correction_config(algo: AlgoConfig) -> CorrectionConfig:
    # The config schema mirrors CorrectionConfig field for field (only the `enable` default differs).
    return CorrectionConfig(**dataclasses.asdict(algo.correction))


def apply_correction(algo: AlgoConfig, batch: TrainBatch, dp_group) -> tuple[torch.Tensor, dict]:
    """Sets the batch's correction weights and mask; returns which sequences were rejected (B,) and metrics."""
    cfg = correction_config(algo)
    corr, metrics = correct(cfg, batch.logp_old, batch.logp_sparse, batch.mask, reduce_sum=dist_reduce_sum(dp_group))
    if cfg.enable and cfg.mode == "apply":
        batch.weights, batch.mask, batch.kl_weights = corr.weights, corr.mask, corr.kl_weights
    return corr.seq_rejected, metrics


def set_advantages(algo: AlgoConfig, batch: TrainBatch, samples: list[Sample], n: int, rejected: torch.Tensor | None,
                   loss_cfg: LossConfig, dp_group=None) -> dict:
    """`rejected` (B,) is None on the single-update path, which is never taken when advantages depend on it.

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


def loss_config(algo: AlgoConfig) -> LossConfig:
    return LossConfig(policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                      loss_agg=algo.loss_agg, kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, kl_mode=algo.kl.mode,
                      entropy_coef=algo.entropy_coef)


def make_loss_fn(cfg: LossConfig):
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


def fused_old_logprobs(cfg: Config) -> tuple[bool, str]:
    """Whether the update's own forward can supply logp_old (no separate pass), and if not, why.

    With one optimizer step per rollout the old policy IS the learner at the first forward, so the detached
    log-probs of the loss forward are exactly logp_old. The correction's per-token decisions are local to a
    sequence; only its global normalizers (the kept-token count and the weights' batch mean) need every
    micro-batch, and they are applied once to the accumulated gradient (`FusedOldLogprobLoss.finalize`).
    """
    a, algo, c = cfg.actor, cfg.algo, cfg.algo.correction
    applying = c.enable and c.mode == "apply"
    kl_in_loss = algo.kl.coef != 0 and algo.kl.mode == "loss"
    if not a.fuse_old_logprobs:
        return False, "actor.fuse_old_logprobs=false"
    if a.updates_per_rollout != 1 or a.ppo_epochs != 1:
        return False, "several optimizer steps per rollout (actor.updates_per_rollout / actor.ppo_epochs > 1)"
    if algo.kl.coef != 0 and algo.kl.mode == "reward":
        return False, "algo.kl.mode=reward puts KL(old || ref) into the rewards, before the update"
    if applying and not c.rejected_in_baseline:
        return False, "algo.correction.rejected_in_baseline=false: advantages need the rejections before the update"
    if applying and c.is_batch_normalize and (algo.entropy_coef != 0 or (kl_in_loss and not c.apply_to_kl)):
        return False, ("the batch-normalized correction weights scale the policy term but not the KL / entropy terms, "
                       "so one gradient scale cannot apply the normalizer afterwards")
    return True, ""


class FusedOldLogprobLoss:
    """The loss closure of the single-update path: logp_old = the forward's own log-probs, detached.

    Each micro-batch decides the correction for its sequences (`token_decisions`: masks, veto, capped weights) and
    computes the loss with the pre-correction token count and unnormalized weights; `finalize` then runs `correct`
    on the collected log-probs (the same function, over the whole minibatch and every DP rank) and returns the one
    gradient scale that turns those into the exact normalizers: kept tokens instead of response tokens, and the
    weights' batch mean. Losses are linear in both, so the update equals the separate-pass one up to rounding.
    """

    def __init__(self, algo: AlgoConfig, loss_cfg: LossConfig, dp_group) -> None:
        self.cfg, self.loss_cfg, self.dp_group = correction_config(algo), loss_cfg, dp_group
        self.applying = self.cfg.enable and self.cfg.mode == "apply"
        self.metrics: dict[str, float] = {}
        self._logp_old: torch.Tensor | None = None

    def __call__(self, logp, entropy, batch: TrainBatch, idx, norm):
        if self._logp_old is None:
            self._logp_old = torch.zeros_like(batch.mask, dtype=logp.dtype)
        T = logp.shape[1]
        logp_old = logp.detach()  # (b, T)
        self._logp_old[idx, :T] = logp_old
        mask = batch.mask[idx, :T]
        weights = None
        if self.applying:
            mask, weights = token_decisions(self.cfg, logp_old, batch.logp_sparse[idx, :T], mask)
        use_kl = self.loss_cfg.kl_coef != 0 and self.loss_cfg.kl_mode == "loss"
        return policy_objective(
            self.loss_cfg, logp, logp_old, batch.advantages[idx][:, None], mask, norm, weights=weights,
            logp_ref=batch.logp_ref[idx, :T] if use_kl else None, entropy=entropy,
            kl_weights=weights if use_kl and self.cfg.apply_to_kl else None,
        )

    def finalize(self, batch: TrainBatch, index: list[int], norm: Normalizer) -> tuple[float, dict[str, float]]:
        logp_old = self._logp_old if self._logp_old is not None else torch.zeros_like(batch.mask)
        corr, self.metrics = correct(self.cfg, logp_old[index], batch.logp_sparse[index], batch.mask[index],
                                     reduce_sum=dist_reduce_sum(self.dp_group))
        self.metrics = self.metrics | low_xi_metrics(logp_old[index], batch.logp_sparse[index], batch.mask[index],
                                                     batch.advantages[index], dist_reduce_sum(self.dp_group))
        batch.logp_old, self._logp_old = logp_old, None
        if not self.applying:
            return 1.0, {}
        tokens = norm.tokens / corr.kept_tokens if self.loss_cfg.loss_agg == "token" and corr.kept_tokens > 0 else 1.0
        pg = tokens / corr.norm_factor
        kl = pg if self.cfg.apply_to_kl else tokens
        return pg, {"actor/loss": pg, "actor/pg_loss": pg, "actor/kl": kl, "actor/entropy": tokens}


def _units(pool: list, world: int, share_prompts: bool) -> list[tuple[list[int], int]]:
    """(indices into `pool`, token cost) of what `balance_ranks` moves: single sequences, or prompt groups."""
    lengths = [len(seq[1]) for seq in pool]
    if not share_prompts:
        return [([j], n) for j, n in enumerate(lengths)]
    prompt_lens = [seq[2] for seq in pool]
    keys = [prompt_key(seq[1], seq[2]) for seq in pool]
    total = sum(lengths) - sum(prompt_lens) + sum({key: p for key, p in zip(keys, prompt_lens)}.values())  # prompts once
    return prompt_units(keys, prompt_lens, lengths, max(1, total // (2 * world)))


def _keep_home_if_no_worse(everyone: list, pool: list, k: int, parts: list[list[int]], loads: list[int]):
    home_parts, start = [], 0
    for part in everyone:
        size = sum(seq[0] == k for seq in part)
        home_parts.append(list(range(start, start + size)))
        start += size
    home_loads = [sum(cost for _, cost in _units([pool[j] for j in hp], 1, True)) for hp in home_parts]
    return (home_parts, home_loads) if max(home_loads) <= max(loads) else (parts, loads)


_PER_TOKEN = ("mask", "logp_old", "logp_sparse", "logp_ref", "weights", "kl_weights")


def balance_ranks(batch: TrainBatch, num_minibatches: int, dp_group,
                  share_prompts: bool = False) -> tuple[TrainBatch, list[list[int]], dict]:
    """Moves sequences between DP ranks so that every rank trains on a near-equal number of tokens.

    Rollouts are colocated, so each rank starts with the sequences its own engine sampled, and their token
    counts differ (long-tailed response lengths). Every FSDP collective waits for the slowest rank, so the
    update time follows the heaviest one. Each global minibatch (the union of every rank's k-th contiguous
    slice, which is what `Actor.update` would train on at optimizer step k) is split over the ranks by
    Karmarkar-Karp on token counts. The optimizer steps therefore see the same sequence sets as without
    balancing, and since losses are normalized by all-reduced counts, the update is the same up to the order
    of floating-point sums. Returns this rank's new batch, its minibatches (local indices, one list per
    optimizer step) and metrics (max/mean token load over ranks, before and after). Each row of the new batch
    keeps its `origin`, the (DP rank, row) it was rolled out at, so logged samples can find it (trainer/samples.py).
    With `share_prompts` (`actor.share_prompts`) the units moved are a prompt's samples, in pieces of at most half
    a rank's fair share, costed as the tokens a shared-prompt forward computes (prompt once + responses), so a
    prompt's samples stay together and share its forward (actor/logprobs.py).
    """
    world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    home = contiguous_minibatches(len(batch), num_minibatches)
    if world == 1:
        return batch, home, {}
    rank = dist.get_rank(dp_group)
    fields = [f for f in _PER_TOKEN if getattr(batch, f) is not None]
    mine = []
    for k, index in enumerate(home):
        for i in index:
            r = len(batch.ids[i]) - batch.prompt_lens[i]
            origin = batch.origin[i] if batch.origin is not None else (rank, i)
            mine.append((k, batch.ids[i], batch.prompt_lens[i], float(batch.advantages[i]),
                         [getattr(batch, f)[i, :r].detach().cpu() for f in fields], origin))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=dp_group)
    before = [sum(cost for _, cost in _units(part, 1, share_prompts)) for part in everyone]
    rows, minibatches, after = [], [], [0] * world
    for k in range(num_minibatches):
        pool = [seq for part in everyone for seq in part if seq[0] == k]  # same order on every rank
        units = _units(pool, world, share_prompts)
        costs = [cost for _, cost in units]
        unit_parts = balanced_partition(costs, world)  # deterministic: every rank computes the same split
        parts = [sorted(j for u in share for j in units[u][0]) for share in unit_parts]
        loads = [sum(costs[u] for u in share) for share in unit_parts]
        if share_prompts:  # where the split is no better than what the ranks rolled out (whole groups each), keep that
            parts, loads = _keep_home_if_no_worse(everyone, pool, k, parts, loads)
        for r in range(world):
            after[r] += loads[r]
        minibatches.append(list(range(len(rows), len(rows) + len(parts[rank]))))
        rows.extend(pool[j] for j in parts[rank])
    device = batch.mask.device
    T = max([1] + [len(seq[1]) - seq[2] for seq in rows])
    per_token = {}
    for j, f in enumerate(fields):
        t = torch.zeros(len(rows), T, dtype=getattr(batch, f).dtype)
        for i, seq in enumerate(rows):
            t[i, : len(seq[4][j])] = seq[4][j]
        per_token[f] = t.to(device)
    new = TrainBatch(ids=[seq[1] for seq in rows], prompt_lens=[seq[2] for seq in rows],
                     advantages=torch.tensor([seq[3] for seq in rows], dtype=torch.float32, device=device),
                     origin=[seq[5] for seq in rows], **per_token)
    mean = max(sum(before) / world, 1e-9)
    metrics = {"perf/dp_load_imbalance_before": max(before) / mean, "perf/dp_load_imbalance": max(after) / mean}
    return new, minibatches, metrics
