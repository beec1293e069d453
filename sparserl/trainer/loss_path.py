"""The loss path of a step: where the update's logp_old comes from, and with it where the sparsity correction runs
and which loss the update takes. Two paths: the separate pass (a forward before the update, the correction on its
output, then the plain loss) and the fused path (the update's own forward gives logp_old and the correction runs
inside the loss; `actor.fuse_old_logprobs`).

`LossPath.choose(cfg, actor, loss_cfg, sampled)` returns one of the two with the same calls, one per step of the
trainer that depends on the choice:
  3. `compute(batch, timer)`: logp_old into the batch (the separate pass, inside `timer`), or nothing yet;
  4. `correct(batch)`: the sparse/dense correction before the update, or nothing: it then runs inside the update;
  6. `loss_fn()`: the loss closure of `Actor.update`;
  after 6, `correction_metrics()`: the step's `correction/*` and `mismatch/*` metrics.
Either strategy hands the dense log-probs it computes of the sparse samples to `sampled` (algo/sampler_stats.py),
the step's record of the sampler's mismatch before any filter, unless dynamic sampling's rounds did already.

`SeparatePass` is the general path. `FusedPass` drops one forward over the whole batch: with one optimizer step per rollout the old policy IS the learner at the update's first forward, so the
detached log-probs of the loss forward are exactly logp_old, and the correction is computed inside the update
(`FusedOldLogprobLoss`). `fused_old_logprobs` says when that gives the same update, and if not, why.
Dynamic sampling with the correction applied (trainer/dynamic_sampling.py) needs the rejections before the update
to drop groups rejected whole: it takes the separate pass, run per rollout round, and `SeparatePass.compute` finds
logp_old already in the batch. The rescue of rejected samples (`algo.correction.rescue=dense`, trainer/rescue.py)
needs them before the update too: it takes the separate pass, and splices the redraws' logp_old into the batch.

Left out on purpose: a stale logp_old (reusing the sampler's, or the previous step's) and the fused path
for several optimizer steps per rollout (after the first step the learner is no longer the old policy).
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from sparserl.actor.actor import Actor, LossFn, TrainBatch
from sparserl.algo.aggregation import Normalizer
from sparserl.algo.correction import correct, dist_reduce_sum, low_xi_metrics, token_decisions
from sparserl.algo.loss import LossConfig, policy_objective
from sparserl.algo.sampler_stats import SamplerStats
from sparserl.config import AlgoConfig, Config
from sparserl.algo.advantages import is_per_token
from sparserl.trainer.loss import advantage_rows, apply_correction, make_loss_fn


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
    if a.lora.rank > 0 and a.lora.dropout > 0:
        return False, ("adapter dropout (actor.lora.dropout) perturbs the update's forward, so its log-probs are not "
                       "the old policy's")
    if a.updates_per_rollout != 1 or a.ppo_epochs != 1:
        return False, "several optimizer steps per rollout (actor.updates_per_rollout / actor.ppo_epochs > 1)"
    if algo.kl.coef != 0 and algo.kl.mode == "reward":
        return False, "algo.kl.mode=reward puts KL(old || ref) into the rewards, before the update"
    if applying and not c.rejected_in_baseline:
        return False, "algo.correction.rejected_in_baseline=false: advantages need the rejections before the update"
    if applying and is_per_token(algo.adv_estimator):
        return False, (f"algo.adv_estimator={algo.adv_estimator} with the correction applied: per-token advantages "
                       "are whitened over the loss tokens, which the correction decides before the update")
    if applying and c.rescue != "none":
        return False, (f"algo.correction.rescue={c.rescue} re-rolls the rejected sequences, so the rejections are needed "
                       "before the update")
    if applying and algo.dynamic_sampling.enable:
        return False, ("algo.dynamic_sampling with the correction applied: groups it rejects whole are dropped before "
                       "the update")
    if algo.dynamic_sampling.enable and cfg.rollout.kv.budget == "auto":
        return False, ("algo.dynamic_sampling with rollout.kv.budget=auto: every round's samples are scored densely for "
                       "the budget controller's tail, the dropped groups' too, and carry their log-probs into the batch")
    if applying and c.is_batch_normalize and (algo.entropy_coef != 0 or (kl_in_loss and not c.apply_to_kl)):
        return False, ("the batch-normalized correction weights scale the policy term but not the KL / entropy terms, "
                       "so one gradient scale cannot apply the normalizer afterwards")
    return True, ""


class LossPath:
    """The trainer's one handle on logp_old, the correction and the loss (separate or fused); see the module
    docstring for the calls."""

    description: str  # for the run's log: "old log-probs: <description>"

    @staticmethod
    def choose(cfg: Config, actor: Actor, loss_cfg: LossConfig, sampled: SamplerStats | None = None) -> LossPath:
        fused, why_not = fused_old_logprobs(cfg)
        if fused:
            return FusedPass(cfg.algo, loss_cfg, actor.dp_group, sampled)
        return SeparatePass(cfg.algo, loss_cfg, actor, why_not, sampled)

    def compute(self, batch: TrainBatch, timer: AbstractContextManager) -> None:
        """`timer`: the phase's timer (utils/timers.py), entered only around a pass that runs."""
        raise NotImplementedError

    def correct(self, batch: TrainBatch) -> torch.Tensor | None:
        """The rejected sequences (B,), or None where the correction runs inside the update."""
        raise NotImplementedError

    def loss_fn(self) -> LossFn:
        raise NotImplementedError

    def correction_metrics(self) -> dict[str, float]:
        """Call after the update."""
        raise NotImplementedError


class SeparatePass(LossPath):
    """logp_old from a no-grad forward over the batch before the update; the correction then runs on it (it sets
    the batch's weights and mask), and the update's loss reads them (`make_loss_fn`)."""

    def __init__(self, algo: AlgoConfig, loss_cfg: LossConfig, actor: Actor, reason: str,
                 sampled: SamplerStats | None = None) -> None:
        self.algo, self.loss_cfg, self.actor, self.sampled = algo, loss_cfg, actor, sampled
        self.description = f"a separate forward pass ({reason})"
        self._metrics: dict[str, float] = {}

    def compute(self, batch: TrainBatch, timer: AbstractContextManager) -> None:
        if batch.logp_old is not None:  # dynamic sampling's rounds computed it (the same weights), to judge groups
            return
        with timer:
            batch.logp_old = self.actor.logprobs(batch)
        if self.sampled is not None:
            self.sampled.add_batch(batch.logp_old, batch)

    def correct(self, batch: TrainBatch) -> torch.Tensor:
        rejected, self._metrics = apply_correction(self.algo, batch, self.actor.dp_group)
        return rejected

    def loss_fn(self) -> LossFn:
        return make_loss_fn(self.loss_cfg)

    def correction_metrics(self) -> dict[str, float]:
        return self._metrics


class FusedPass(LossPath):
    """logp_old from the update's own forward: nothing before the update, a fresh `FusedOldLogprobLoss` per
    update, whose `finalize` leaves logp_old in the batch and the correction metrics on the loss."""

    description = "from the update's own forward (one update per rollout)"

    def __init__(self, algo: AlgoConfig, loss_cfg: LossConfig, dp_group, sampled: SamplerStats | None = None) -> None:
        self.algo, self.loss_cfg, self.dp_group, self.sampled = algo, loss_cfg, dp_group, sampled
        self._loss: FusedOldLogprobLoss | None = None

    def compute(self, batch: TrainBatch, timer: AbstractContextManager) -> None:
        pass

    def correct(self, batch: TrainBatch) -> None:
        return None

    def loss_fn(self) -> LossFn:
        self._loss = FusedOldLogprobLoss(self.algo, self.loss_cfg, self.dp_group, self.sampled)
        return self._loss

    def correction_metrics(self) -> dict[str, float]:
        assert self._loss is not None, "correction_metrics() comes after the update"
        return self._loss.metrics


class FusedOldLogprobLoss:
    """The loss closure of the fused path: logp_old = the forward's own log-probs, detached.

    Each micro-batch decides the correction for its sequences (`token_decisions`: masks, veto, capped weights) and
    computes the loss with the pre-correction token count and unnormalized weights; `finalize` then runs `correct`
    on the collected log-probs (the same function, over the whole minibatch and every DP rank) and returns the one
    gradient scale that turns those into the exact normalizers: kept tokens instead of response tokens, and the
    weights' batch mean. Losses are linear in both, so the update equals the separate-pass one up to rounding.
    """

    def __init__(self, algo: AlgoConfig, loss_cfg: LossConfig, dp_group, sampled: SamplerStats | None = None) -> None:
        self.cfg, self.loss_cfg, self.dp_group, self.sampled = algo.correction, loss_cfg, dp_group, sampled
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
            self.loss_cfg, logp, logp_old, advantage_rows(batch.advantages, idx, T), mask, norm, weights=weights,
            logp_ref=batch.logp_ref[idx, :T] if use_kl else None, entropy=entropy,
            kl_weights=weights if use_kl and self.cfg.apply_to_kl else None, host_metrics=False,
        )

    def finalize(self, batch: TrainBatch, index: list[int], norm: Normalizer) -> tuple[float, dict[str, float]]:
        logp_old = self._logp_old if self._logp_old is not None else torch.zeros_like(batch.mask)
        corr, self.metrics = correct(self.cfg, logp_old[index], batch.logp_sparse[index], batch.mask[index],
                                     reduce_sum=dist_reduce_sum(self.dp_group))
        # The tail over the sampler's tokens, all of them (length-cut ones too), as on the separate-pass path.
        response = batch.response_mask if batch.response_mask is not None else batch.mask
        self.metrics = self.metrics | low_xi_metrics(logp_old[index], batch.logp_sparse[index], response[index],
                                                     batch.advantages[index], dist_reduce_sum(self.dp_group))
        if self.sampled is not None:
            self.sampled.add_batch(logp_old, batch, index)
        batch.logp_old, self._logp_old = logp_old, None
        if not self.applying:
            return 1.0, {}
        tokens = norm.tokens / corr.kept_tokens if self.loss_cfg.loss_agg == "token" and corr.kept_tokens > 0 else 1.0
        pg = tokens / corr.norm_factor
        kl = pg if self.cfg.apply_to_kl else tokens
        return pg, {"actor/loss": pg, "actor/pg_loss": pg, "actor/kl": kl, "actor/entropy": tokens}
