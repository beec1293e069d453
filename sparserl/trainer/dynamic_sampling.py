"""DAPO dynamic sampling (`algo.dynamic_sampling.*`): a step trains only on groups that carry a learning signal,
and rolls out more prompts, in rounds, until it has `trainer.prompts_per_step` of them.

A group (one prompt's `rollout.n` samples) is informative when some sample that stays in the loss gets a reward
signal under the estimator (`informative_groups`, algo/advantages.py `reward_signal`). With a group baseline (grpo,
drgrpo, rloo, reinforce_pp_baseline) that drops the groups whose rewards all tie (all right or all wrong: their
advantages carry no reward signal); reinforce_pp measures each reward against the batch's, so a tied group keeps
one. Every estimator drops the groups none of whose samples stays in the loss: all cut by the length cap under
`algo.overlong.mask`, or all rejected by the sparsity correction under `algo.correction.mode=apply`. The rewards are
the ones the advantages see (the overlong penalty included, `advantages.shaped_rewards`); a KL penalty in the
reward (`algo.kl.mode=reward`) is not: it needs the reference's pass, and it is a regulariser, not a signal worth
another rollout round (REINFORCE++ gives a tied group non-zero per-token advantages from it all the same).

The correction's rejections need logp_old. With the correction applied, each round therefore runs the dense
pass (`dense_logprobs`, the engine asleep meanwhile) on its reward-informative groups, and the kept groups carry
those log-probs into the batch, so the update needs no other pass; the fused path is off in that case
(trainer/loss_path.py), since it only learns the rejections inside the update.

Rounds (`collect`):
  1. round 1 rolls out the step's `prompts_per_step` prompts (the sampler's `next()`), exactly as without
     dynamic sampling (same seeds, same samples);
  2. every rank judges its own groups and all-gathers its count, so every rank makes the same decision;
  3. while the step has fewer informative groups than the target and `max_rounds` allows, the next round draws
     `next_round_size` more prompts (`sampler.more`), split over the DP ranks; round r's engine seed is
     `round_seed(seed, step, r)` and a prompt's seed index its place in the round, so its samples differ from
     the other rounds' and do not depend on the number of processes;
  4. `plan_groups` keeps the first informative groups in (round, place) order, at most the target and a
     multiple of the DP size, so every rank trains on as many groups; a rank keeps its own groups up to its
     share and the surplus moves to the ranks short of theirs (one `all_gather_object` of the moving groups).
     With none to keep, the step trains on round 1's groups as they are and says so in the log; under the
     correction, the groups round 1 did not score (tied rewards) get their dense pass then, so the batch arrives
     with every logp_old.
With tp or cp > 1 only a replica group's owner rolls out; its peers receive each round's samples (`roll` does
it), so every rank of a replica group judges the same groups and makes the same moves over its DP group.

Cost: each extra round is a full rollout wait (the slowest sample), plus, with the correction applied, a dense
pass and, under `rollout.release_weights`, a weight sync to wake the engine again.

Left out on purpose: carrying surplus informative groups over to the next step (they would be off-policy by one
update), returning unused prompts to the sampler, and a filter on the KL-penalized reward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.algo.advantages import reward_signal
from sparserl.algo.correction import explain
from sparserl.config import AlgoConfig
from sparserl.data.prompt_sampler import StepBatch
from sparserl.engines.protocol import EngineStats
from sparserl.rollout.episode import Sample, cut_by_length
from sparserl.trainer.advantages import shaped_rewards
from sparserl.trainer.train_batch import to_train_batch
from sparserl.utils.logging import log0
from sparserl.utils.seed import derive, step_seed


def round_seed(seed: int, step: int, round_: int) -> int:
    """The engine seed of rollout round `round_` (1, 2, ...) of training step `step`; round 1's is the step's."""
    base = step_seed(seed, step)
    return base if round_ == 1 else derive(base, (round_, 104_729))


# ---------------------------------------------------------------------------------------------- pure decisions
def informative_groups(rewards: torch.Tensor, in_loss: torch.Tensor, estimator: str,
                       valid: torch.Tensor | None = None) -> torch.Tensor:
    """(G,) bool: whether some sample of the group that stays in the loss (`in_loss` (G, n) bool) gets a reward
    signal from `rewards` (G, n) under `estimator` (`reward_signal`); `valid` (G, n): the members counted in the
    baseline."""
    if rewards.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    return (reward_signal(estimator, rewards, valid) & in_loss.to(torch.bool)).any(-1)


def keep_going(informative: int, target: int, rounds: int, max_rounds: int) -> bool:
    """Whether to roll out another round: the step is short of its target and rounds are left."""
    return informative < target and rounds < max_rounds


def next_round_size(target: int, informative: int, drawn: int, cap: int) -> int:
    """Prompts the next round draws: enough to fill the gap at the informative rate p seen so far this step with
    about 98% probability (the gap plus two binomial standard deviations, over p), at least the gap, at most `cap`
    (a round never rolls out more than a step). With nothing informative yet: `cap`."""
    need = target - informative
    if need <= 0:
        return 0
    if informative == 0 or drawn == 0:
        return cap
    p = informative / drawn
    want = (need + 2.0 * math.sqrt(need * (1.0 - p))) / p
    return max(need, min(cap, math.ceil(want - 1e-9)))


@dataclass(frozen=True)
class Plan:
    """Which informative groups the step trains on and where (the same on every rank)."""

    total: int  # groups trained on, all ranks
    local: list[int]  # per rank: how many of its own informative groups (the first ones) it keeps
    moves: list[tuple[int, int, int]]  # (from rank, index among its informative groups, to rank), in arrival order


def plan_groups(counts: list[list[int]], target: int, dp: int) -> Plan:
    """`counts[r][k]`: informative groups rank k found in round r (in its own order). Keeps the first groups in
    (round, rank, place) order, which is the order of the prompts in each round: `target` of them, or as many as
    there are rounded down to a multiple of `dp`; each rank keeps up to its share of its own, and the surplus
    goes, in that order, to the ranks short of theirs, lowest rank first."""
    order: list[tuple[int, int]] = []  # (rank, index among its informative groups)
    seen = [0] * dp
    for per_rank in counts:
        for k, c in enumerate(per_rank):
            order += [(k, seen[k] + j) for j in range(c)]
            seen[k] += c
    total = min(target, len(order)) // dp * dp
    share = total // dp
    local, pool = [0] * dp, []
    for k, i in order[:total]:
        if local[k] < share:
            local[k] += 1
        else:
            pool.append((k, i))
    filled, moves, dst = list(local), [], 0
    for k, i in pool:
        while filled[dst] >= share:
            dst += 1
        moves.append((k, i, dst))
        filled[dst] += 1
    return Plan(total, local, moves)


def merge_rollout_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The rollout worker's per-rank metrics of several rounds, (samples, metrics) each, as one round's: counts and
    sums (`.../count`, `.../reward_sum`) add up, every other value is a mean weighted by the round's samples."""
    total = sum(n for n, _ in parts)
    out: dict[str, float] = {}
    for n, metrics in parts:
        for key, value in metrics.items():
            summed = key.endswith(("/count", "/reward_sum"))
            out[key] = out.get(key, 0.0) + (value if summed else value * n / max(total, 1))
    return out


# ---------------------------------------------------------------------------------------------- the rounds
@dataclass
class Round:
    """One rollout round on this rank (a TP peer holds its owner's)."""

    samples: list[Sample]
    metrics: dict[str, float]  # the rollout worker's
    stats: EngineStats  # the engine's counters since the step began


@dataclass
class Group:
    """One prompt's samples as dynamic sampling keeps and moves them."""

    key: tuple[int, int]  # (round, place of the prompt in the round's global list)
    samples: list[Sample]
    logp_old: list[torch.Tensor] | None = None  # each sample's dense log-probs (response length, CPU), if computed


@dataclass
class StepRollout:
    """What the step trains on (this rank's share) and what its rollout metrics cover (every round)."""

    samples: list[Sample]  # to train on, a prompt's n samples together
    logp_old: list[torch.Tensor] | None  # theirs, where the rounds computed them (the correction applied)
    keys: list[tuple[int, int]]  # (round, place in the round's prompts) of each of their groups
    rolled: list[Sample]  # every sample this rank rolled out (or received from its replica group's owner) in the step
    rollout_metrics: dict[str, float]
    engine_stats: EngineStats
    metrics: dict[str, float]  # dynamic/*


Roll = Callable[[StepBatch, int], Round]  # (the round's prompts, round number) -> this rank's round
DenseLogprobs = Callable[[TrainBatch], torch.Tensor]  # a collective: every rank calls it every round


class DynamicSampling:
    """`collect(first, roll, dense_logprobs)` runs a step's rounds (one, when off); see the module docstring."""

    def __init__(self, algo: AlgoConfig, n: int, max_new_tokens: int, target: int, sampler, dp_group, dp_rank: int,
                 dp_size: int, device, score_every_group: bool = False) -> None:
        self.algo, self.n, self.max_new_tokens, self.target = algo, n, max_new_tokens, target
        self.sampler, self.dp_group, self.device = sampler, dp_group, device
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.enabled = algo.dynamic_sampling.enable
        c = algo.correction
        self.judges_correction = self.enabled and c.enable and c.mode == "apply"  # needs logp_old every round
        # rollout.kv.budget=auto: the controller steers by the tail of every sampled token, so each round's groups
        # are all scored densely, the ones dropped for tied rewards too (`score_every_group`, set by the trainer).
        self.scores_every_group = self.enabled and score_every_group
        self.scores_rounds = self.judges_correction or self.scores_every_group  # each round runs a dense pass

    def collect(self, first: StepBatch, roll: Roll, dense_logprobs: DenseLogprobs | None = None) -> StepRollout:
        if not self.enabled:
            r = roll(first, 1)
            return StepRollout(r.samples, None, [(1, first.local_start + g) for g in range(len(r.samples) // self.n)],
                               r.samples, r.metrics, r.stats, {})
        assert dense_logprobs is not None or not self.scores_rounds, "the rounds' judges need logp_old"
        self._first_groups: list[Group] = []
        rounds: list[Round] = []
        mine: list[Group] = []  # this rank's informative groups, in order
        counts: list[list[int]] = []  # per round, every rank's count
        draw, drawn = first, 0
        while True:
            rounds.append(roll(draw, len(rounds) + 1))
            drawn += len(draw.global_indices)
            found = self.judge(rounds[-1].samples, len(rounds), draw.local_start, dense_logprobs)
            mine += found
            counts.append(self._gather_count(len(found)))
            informative = sum(map(sum, counts))
            if not keep_going(informative, self.target, len(rounds), self.algo.dynamic_sampling.max_rounds):
                break
            draw = self.sampler.more(next_round_size(self.target, informative, drawn, self.target), len(rounds) + 1)
        plan = plan_groups(counts, self.target, self.dp_size)
        if plan.total:
            groups = self._exchange(mine, plan)
        else:
            signal = ("no group carries a learning signal (tied rewards, or no sample left in the loss): the "
                      "policy-gradient term is 0 and only the entropy and KL terms move the weights" if informative == 0 else f"fewer than the {self.dp_size} data-parallel ranks")
            log0(f"dynamic sampling: {informative} informative group(s) in {len(rounds)} round(s), {signal}; the step "
                 f"trains on round 1's groups as they are")
            groups = self._first_groups
            if self.scores_rounds:  # the groups round 1 did not score: one more dense pass (a collective)
                unscored = [g for g in groups if g.logp_old is None]
                self._score(unscored, dense_logprobs)
        samples = [s for g in groups for s in g.samples]
        for i, s in enumerate(samples):
            s.group = i // self.n  # the batch's groups, in order
        logp_old = [row for g in groups for row in g.logp_old] if groups and groups[0].logp_old is not None else None
        rolled = [s for r in rounds for s in r.samples]
        metrics = {"dynamic/rounds": float(len(rounds)), "dynamic/prompts_drawn": float(drawn),
                   "dynamic/informative_frac": informative / max(drawn, 1),
                   "dynamic/groups": float(plan.total or len(first.global_indices)),
                   "dynamic/target_reached": float(informative >= self.target)}
        merged = merge_rollout_metrics([(len(r.samples), r.metrics) for r in rounds])
        return StepRollout(samples, logp_old, [g.key for g in groups], rolled, merged, rounds[-1].stats, metrics)

    def judge(self, samples: list[Sample], round_: int, start: int, dense_logprobs: DenseLogprobs | None) -> list[Group]:
        """This rank's informative groups of a round whose prompts start at `start` in the round's global list."""
        n, algo = self.n, self.algo
        groups = [Group((round_, start + g), samples[g * n: (g + 1) * n]) for g in range(len(samples) // n)]
        if round_ == 1:
            self._first_groups = groups  # the step's fallback trains on them (`collect`)
        rewards, _ = shaped_rewards(algo, samples, self.max_new_tokens)
        in_loss = torch.tensor([any(s.loss_mask) and not (algo.overlong.mask and cut_by_length(s)) for s in samples],
                               dtype=torch.bool)  # (B,) a model token left in the loss
        keep = informative_groups(rewards.view(-1, n), in_loss.view(-1, n), algo.adv_estimator)
        if dense_logprobs is None:
            return [g for g, k in zip(groups, keep.tolist()) if k]
        if self.scores_every_group:  # the tail's pass over every group, informative or not (one collective)
            self._score(groups, dense_logprobs)
        groups = [g for g, k in zip(groups, keep.tolist()) if k]
        if not self.judges_correction:
            return groups
        # The correction's rejections, on the reward-informative groups only (the pass is a collective: every rank
        # runs it, with no sequences where it has none).
        picked = [s for g in groups for s in g.samples]
        batch, logp_old = self._scored(groups, dense_logprobs)
        _, decision = explain(algo.correction, logp_old, batch.logp_sparse, batch.mask)
        in_loss = decision.keep.any(-1).cpu()  # (B,) some token survives the correction
        valid = None if algo.correction.rejected_in_baseline else ~(decision.veto | decision.geo).cpu().view(-1, n)
        rewards, _ = shaped_rewards(algo, picked, self.max_new_tokens)
        keep = informative_groups(rewards.view(-1, n), in_loss.view(-1, n), algo.adv_estimator, valid)
        return [g for g, k in zip(groups, keep.tolist()) if k]

    def _score(self, groups: list[Group], dense_logprobs: DenseLogprobs) -> tuple[TrainBatch, torch.Tensor]:
        """The dense pass over `groups` (a collective: every rank runs it, with no sequences where it has none); each
        group keeps its rows in `logp_old`. Returns the pass's batch and log-probs."""
        batch = to_train_batch([s for g in groups for s in g.samples], self.device, mask_overlong=self.algo.overlong.mask)
        logp_old = dense_logprobs(batch)
        if logp_old is None:  # no rank had a sequence to score
            logp_old = torch.zeros_like(batch.mask)
        rows = logp_old.detach().cpu()
        for gi, g in enumerate(groups):
            g.logp_old = [rows[gi * self.n + j, : len(s.response_ids)].clone() for j, s in enumerate(g.samples)]
        return batch, logp_old

    def _scored(self, groups: list[Group], dense_logprobs: DenseLogprobs) -> tuple[TrainBatch, torch.Tensor]:
        """`_score`, or, where every group was scored already, the batch and log-probs from what they carry."""
        if not self.scores_every_group:
            return self._score(groups, dense_logprobs)
        batch = to_train_batch([s for g in groups for s in g.samples], self.device, mask_overlong=self.algo.overlong.mask)
        dtype = groups[0].logp_old[0].dtype if groups else torch.float32
        logp_old = torch.zeros(batch.mask.shape, dtype=dtype)
        for gi, g in enumerate(groups):
            for j, row in enumerate(g.logp_old):
                logp_old[gi * self.n + j, : len(row)] = row
        return batch, logp_old.to(batch.mask.device)

    def _gather_count(self, count: int) -> list[int]:
        if self.dp_size == 1:
            return [count]
        t = torch.tensor([count], dtype=torch.long, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.dp_size)]
        dist.all_gather(out, t, group=self.dp_group)
        return [int(x.item()) for x in out]

    def _exchange(self, mine: list[Group], plan: Plan) -> list[Group]:
        """This rank's groups under `plan`: its own first ones, then those other ranks send it, in plan order."""
        kept = mine[: plan.local[self.dp_rank]]
        if not plan.moves:
            return kept
        sending = {j: mine[i] for j, (src, i, _) in enumerate(plan.moves) if src == self.dp_rank}
        everyone: list[dict[int, Group]] = [None] * self.dp_size
        dist.all_gather_object(everyone, sending, group=self.dp_group)
        arrived = {j: g for part in everyone for j, g in part.items()}
        return kept + [arrived[j] for j, (_, _, dst) in enumerate(plan.moves) if dst == self.dp_rank]
