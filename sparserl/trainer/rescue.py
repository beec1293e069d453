"""The rescue of rejected samples (`algo.correction.rescue=dense`): the sequences the sparsity correction rejects
are rolled out again with a dense KV cache, and the step trains on the new samples in their place.

After the step's logp_old pass (trainer/loss_path.py takes the separate pass for it), `Rescue.run`:
  1. decides which of this rank's sequences the correction rejects (`rejected_sequences`: the veto or the
     geometric-mean bounds, the same decision `correct` takes) and counts them over the DP ranks; with none
     anywhere it stops here (no engine wake, no weight sync);
  2. `pick`s one redraw per rejected sample: its place in the batch, its group's key (round, place of the prompt
     in the round's global list) and its seed index, derived from that key and the sample's place in the group,
     so a redraw does not depend on the number of processes (`rescue_seed_index`, under the engine seed
     `rescue_seed(seed, step)`, apart from every rollout round's);
  3. hands them to the trainer's `redraw` (the same prompt, one new sample each, through the same env loop as the
     rollout, the engine woken with fresh weights and generating densely; with tp or cp > 1 the replica group's
     owner rolls out and its peers receive the new samples);
  4. computes the new samples' logp_old (`dense_logprobs`, a collective: every rank calls it, with no rows where it
     has none) and `splice`s them, samples and log-prob rows, into the rejected samples' places: every group keeps
     its `rollout.n` samples, in order.
The trainer then runs the correction once, on the final batch: its `correction/*` metrics describe what the update
trains on, and `rescue/rejected_before_frac` keeps the share of this batch rejected before the rescue. The sparse
sampler's own tail, before the redraws (xi ~ 1) replaced its rejected sequences, is `sampler/*`
(algo/sampler_stats.py): the redraws' dense pass is not added to it.

The redraws come from the dense policy, so their xi is 1 up to numerics and the correction keeps them; one that it
still rejects stays rejected (one rescue per step). With `algo.dynamic_sampling` the rescue runs on the groups the
rounds kept, after the rounds: a rescued group may end with tied rewards (no learning signal), which the rounds do
not re-judge.

Whole groups (`algo.correction.rescue_group_frac` = f > 0): a group with at least f x n of its samples rejected
is re-rolled whole, its accepted samples too. Where most of a group is rejected, a partial rescue leaves a
group that mixes dense redraws with the few compressed survivors, and at a tight budget those differ in reward
by sampler (measured: redraws 0.40-0.92, survivors ~0.05), so the group's baseline ranks samplers rather than
answers. A whole redraw keeps the baseline within one sampler, at the cost of re-rolling accepted samples.

Left out on purpose: rescuing masked tokens (only whole sequences are re-rolled) and a second rescue of a
rescued sample.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.algo.correction import dist_reduce_sum, explain
from sparserl.algo.correction_config import CorrectionConfig
from sparserl.config import AlgoConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.train_batch import to_train_batch
from sparserl.utils.seed import derive, step_seed

RESCUE_STRIDE = 1_299_709  # a prime: the rescue's engine seed is apart from every rollout round's (`round_seed`)


def rescue_seed(seed: int, step: int) -> int:
    """The engine seed of step `step`'s rescue."""
    return derive(step_seed(seed, step), (1, RESCUE_STRIDE))


def rescue_seed_index(key: tuple[int, int], sample: int, n: int) -> int:
    """The seed index of the redraw of sample `sample` (0..n-1) of the group keyed `key` = (round, place of its
    prompt in the round's global list): unique within a step, the same for any number of processes."""
    round_, place = key
    return derive(round_, (place * n + sample, 1))


@dataclass(frozen=True)
class Redraw:
    """One rejected sample to roll out again."""

    index: int  # its place in this rank's batch
    key: tuple[int, int]  # its group's (round, place of the prompt in the round's global list)
    sample: int  # its place in the group, 0..n-1
    seed_index: int


def rejected_sequences(cfg: CorrectionConfig, batch: TrainBatch) -> torch.Tensor:
    """(B,) bool: the sequences `correct` rejects whole (veto or geometric-mean bounds), from the batch's logp_old."""
    assert batch.logp_old is not None, "the rescue needs logp_old (the separate pass)"
    _, decision = explain(cfg, batch.logp_old, batch.logp_sparse, batch.mask)
    return (decision.veto | decision.geo).cpu()


def pick(rejected: torch.Tensor | list[bool], keys: list[tuple[int, int]], n: int,
         group_frac: float = 0.0) -> list[Redraw]:
    """One `Redraw` per rejected sample, in batch order; `keys[g]` is the key of the batch's group g (samples
    g*n .. g*n+n-1). With `group_frac` > 0, every sample of a group with at least group_frac x n rejected ones."""
    flags = rejected.tolist() if isinstance(rejected, torch.Tensor) else list(rejected)
    assert len(flags) == len(keys) * n, f"{len(flags)} sequences but {len(keys)} groups of {n}"
    if group_frac > 0:
        whole = [sum(flags[g * n: (g + 1) * n]) >= group_frac * n for g in range(len(keys))]
        flags = [f or whole[i // n] for i, f in enumerate(flags)]
    return [Redraw(i, keys[i // n], i % n, rescue_seed_index(keys[i // n], i % n, n))
            for i, flag in enumerate(flags) if flag]


def logp_rows(logp: torch.Tensor | None, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's row of a (B, T) log-prob tensor, cut to its response length, on the CPU."""
    if logp is None:  # no rank had a row to score
        return [torch.zeros(len(s.response_ids)) for s in samples]
    rows = logp.detach().cpu()
    return [rows[i, : len(s.response_ids)].clone() for i, s in enumerate(samples)]


def splice(samples: list[Sample], rows: list[torch.Tensor], redraws: list[Redraw], new_samples: list[Sample],
           new_rows: list[torch.Tensor]) -> tuple[list[Sample], list[torch.Tensor]]:
    """New lists with each redraw's sample and log-prob row in the place of the one it replaces (which keeps its
    group number); everything else, order included, as it was."""
    assert len(redraws) == len(new_samples) == len(new_rows), "one new sample and row per redraw"
    out, out_rows = list(samples), list(rows)
    for r, s, row in zip(redraws, new_samples, new_rows):
        s.group = samples[r.index].group
        out[r.index], out_rows[r.index] = s, row
    return out, out_rows


@dataclass
class Rescued:
    """The step's batch after the rescue (as it was when there was nothing to rescue)."""

    samples: list[Sample]
    batch: TrainBatch
    metrics: dict[str, float]  # rescue/*


RedrawFn = Callable[[list[Redraw]], list[Sample]]  # this rank's redraws -> new samples in order (all ranks call it)
DenseLogprobs = Callable[[TrainBatch], torch.Tensor | None]  # a collective over the DP ranks


class Rescue:
    """`run(samples, batch, keys, redraw, dense_logprobs, timer)`; see the module docstring."""

    def __init__(self, algo: AlgoConfig, n: int, dp_group, device) -> None:
        c = algo.correction
        self.cfg, self.n, self.dp_group, self.device = c, n, dp_group, device
        self.mask_overlong = algo.overlong.mask
        self.enabled = c.enable and c.mode == "apply" and c.rescue == "dense"

    def run(self, samples: list[Sample], batch: TrainBatch, keys: list[tuple[int, int]], redraw: RedrawFn,
            dense_logprobs: DenseLogprobs, timer: AbstractContextManager) -> Rescued:
        """`timer` (the phase's) is entered only when some rank re-rolls a sample."""
        if not self.enabled:
            return Rescued(samples, batch, {})
        reduce = dist_reduce_sum(self.dp_group)
        rejected = rejected_sequences(self.cfg, batch)
        redraws = pick(rejected, keys, self.n, self.cfg.rescue_group_frac)
        scored = int((batch.mask > 0).any(-1).sum())  # sequences with a response token, as correct() counts them
        count, n_rejected, seqs, size = reduce(torch.tensor(
            [len(redraws), int(rejected.sum()), scored, len(samples)], dtype=torch.float64, device=self.device)).tolist()
        metrics = {"rescue/seqs": count, "rescue/frac": count / max(size, 1),
                   "rescue/rejected_before_frac": n_rejected / max(seqs, 1)}
        if count == 0:
            return Rescued(samples, batch, metrics)
        with timer:
            new = redraw(redraws)
            assert len(new) == len(redraws), f"{len(redraws)} redraws but {len(new)} new samples"
            new_rows = logp_rows(dense_logprobs(to_train_batch(new, self.device, self.mask_overlong)), new)
        samples, rows = splice(samples, logp_rows(batch.logp_old, samples), redraws, new, new_rows)
        reward_sum = reduce(torch.tensor([sum(s.reward for s in new)], dtype=torch.float64, device=self.device))
        metrics["rescue/reward_mean"] = float(reward_sum) / count
        return Rescued(samples, to_train_batch(samples, self.device, self.mask_overlong, rows), metrics)
