"""Dynamic sampling's decisions (sparserl/trainer/dynamic_sampling.py) by hand: which groups carry a signal, when the
rounds stop, how many prompts the next round draws, which groups each rank trains on; and the sampler's extra draws
(sparserl/data/prompt_sampler.py `more`), which its saved state must count."""
import math

import pytest
import torch

from sparserl.config import AlgoConfig
from sparserl.data.prompt_sampler import MixtureSampler, PromptSampler, split
from sparserl.rollout.episode import Sample
from sparserl.trainer.dynamic_sampling import (DynamicSampling, Round, informative_groups, keep_going,
                                               merge_rollout_metrics, next_round_size, plan_groups, round_seed)
from sparserl.utils.seed import step_seed


def test_groups_whose_rewards_tie_carry_no_signal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.30001]])
    everyone = torch.ones(4, 3, dtype=torch.bool)
    for estimator in ("grpo", "drgrpo"):
        assert informative_groups(rewards, everyone, estimator).tolist() == [False, False, True, True]


def test_a_group_needs_a_sample_in_the_loss_with_a_non_zero_advantage():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 0.5], [1.0, 0.0]])
    in_loss = torch.tensor([[False, False], [True, False], [False, True], [False, True]])
    assert informative_groups(rewards, in_loss, "grpo").tolist() == [False, True, True, True]
    # [0, 0.5, 1]: the middle sample's advantage is exactly 0 (its reward is the mean), the others' are not.
    mid = torch.tensor([[0.0, 0.5, 1.0]])
    assert not informative_groups(mid, torch.tensor([[False, True, False]]), "grpo").item()
    assert informative_groups(mid, torch.tensor([[True, True, False]]), "grpo").item()
    # Only the valid members count in the baseline: two kept samples that tie carry nothing.
    valid = torch.tensor([[True, False, True]])
    tie = torch.tensor([[1.0, 0.0, 1.0]])
    assert not informative_groups(tie, torch.ones(1, 3, dtype=torch.bool), "grpo", valid).item()
    assert informative_groups(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.bool), "grpo").tolist() == []


def test_rounds_stop_at_the_target_or_the_last_round():
    assert keep_going(informative=3, target=4, rounds=1, max_rounds=4)
    assert not keep_going(informative=4, target=4, rounds=1, max_rounds=4)
    assert not keep_going(informative=9, target=4, rounds=2, max_rounds=4)
    assert not keep_going(informative=0, target=4, rounds=4, max_rounds=4)
    assert not keep_going(informative=0, target=4, rounds=1, max_rounds=1)


def test_next_round_size():
    assert next_round_size(target=8, informative=8, drawn=8, cap=8) == 0
    assert next_round_size(target=8, informative=0, drawn=8, cap=8) == 8  # no rate yet: a full step
    # p = 1/2, need 4: (4 + 2 sqrt(4 * 0.5)) / 0.5 = 8 + 4 sqrt(2) = 13.66 -> 14, capped at 8.
    assert next_round_size(target=8, informative=4, drawn=8, cap=8) == 8
    assert next_round_size(target=64, informative=60, drawn=64, cap=64) == math.ceil((4 + 2 * math.sqrt(4 / 16)) / (60 / 64))
    assert next_round_size(target=64, informative=60, drawn=64, cap=64) == 6
    # Every prompt informative so far: exactly the gap.
    assert next_round_size(target=16, informative=13, drawn=13, cap=16) == 3


def test_plan_keeps_the_first_groups_and_moves_the_surplus():
    # 2 ranks, target 4. Round 1: rank 0 found 3, rank 1 found 0; round 2: rank 0 found 1, rank 1 found 2.
    # Order: r1 (0,0) (0,1) (0,2); r2 (0,3) (1,0) (1,1). Kept: the first 4 -> rank 0's 0..3. Rank 0 keeps 2, sends 2.
    plan = plan_groups([[3, 0], [1, 2]], target=4, dp=2)
    assert plan.total == 4 and plan.local == [2, 0]
    assert plan.moves == [(0, 2, 1), (0, 3, 1)]
    # Short of the target: 3 found over 2 ranks -> 2 trained (a multiple of the DP size), rank 1's surplus trimmed.
    plan = plan_groups([[0, 3]], target=4, dp=2)
    assert plan.total == 2 and plan.local == [0, 1] and plan.moves == [(1, 1, 0)]
    # Nothing to move when every rank found its share; the surplus beyond the target is dropped.
    plan = plan_groups([[2, 5]], target=4, dp=2)
    assert plan.total == 4 and plan.local == [2, 2] and plan.moves == []
    assert plan_groups([[1, 0]], target=4, dp=2).total == 0
    # One rank: the first `target`.
    assert plan_groups([[1], [5]], target=4, dp=1) == plan_groups([[4]], target=4, dp=1)


def test_round_seeds():
    assert round_seed(3, 7, 1) == step_seed(3, 7)  # round 1 samples what a run without dynamic sampling does
    seeds = {round_seed(3, step, r) for step in range(1, 50) for r in range(1, 6)}
    assert len(seeds) == 49 * 5


def test_merged_rollout_metrics():
    merged = merge_rollout_metrics([(4, {"score/mean": 1.0, "openreward/a/count": 4.0}),
                                    (2, {"score/mean": 0.4, "openreward/a/count": 2.0})])
    assert merged["score/mean"] == pytest.approx((4 * 1.0 + 2 * 0.4) / 6) and merged["openreward/a/count"] == 6.0


def test_split_and_the_samplers_extra_draws_resume_exactly():
    assert [split(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    assert [split(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    a = PromptSampler(10, 4, dp_rank=1, dp_size=2, seed=5)
    first = a.next()
    extra = a.more(3, 2)
    assert extra.step == first.step == 0 and len(extra.global_indices) == 3
    assert extra.local_indices == extra.global_indices[1:] and extra.local_start == 1
    state = a.state_dict()
    assert state["step"] == 1 and state["offset"] == 7
    b = PromptSampler(10, 4, dp_rank=1, dp_size=2, seed=5)
    b.load_state_dict(state)
    assert b.next() == a.next() and b.more(5, 2) == a.more(5, 2)
    # The mixture: extra draws follow the weights too and are counted by its state.
    m = MixtureSampler([6, 3], [2.0, 1.0], 3, seed=1)
    m.next()
    extra = m.more(6, 2)
    assert sum(i < 6 for i in extra.global_indices) == 4 and m.step == 1
    m2 = MixtureSampler([6, 3], [2.0, 1.0], 3, seed=1)
    m2.load_state_dict(m.state_dict())
    assert m2.next() == m.next() and m2.more(2, 3) == m.more(2, 3)


def _sample(reward: float, group: int, length: int = 3, cut: bool = False) -> Sample:
    return Sample(group=group, prompt_ids=[1, 2], response_ids=[5] * length, loss_mask=[1] * length,
                  logp_sparse=[-1.0] * length, reward=reward, finish_reason="length" if cut else "stop",
                  turn_lens=[length])


class _FakeRoller:
    """Rewards by prompt row (the real rollout is tested end to end in tests/e2e/test_dynamic_sampling.py)."""

    def __init__(self, rewards_of_row):
        self.rewards_of_row, self.calls = rewards_of_row, []

    def __call__(self, draw, round_):
        self.calls.append((round_, list(draw.global_indices)))
        samples = [_sample(r, g) for g, row in enumerate(draw.local_indices) for r in self.rewards_of_row(row)]
        return Round(samples, {"score/mean": 0.0}, stats=None)


def test_one_process_rounds_fill_the_step():
    """Rows 0..9: even rows tie, odd rows differ. A 4-prompt step needs more rounds until 4 odd rows are in."""
    sampler = PromptSampler(10, 4, seed=0, shuffle=False)
    algo = AlgoConfig()
    algo.dynamic_sampling.enable = True
    ds = DynamicSampling(algo, 2, 8, 4, sampler, None, 0, 1, "cpu")
    roll = _FakeRoller(lambda row: [0.0, 1.0] if row % 2 else [1.0, 1.0])
    out = ds.collect(sampler.next(), roll)
    # Round 1: rows 0..3 (2 informative, p = 1/2); round 2 draws (2 + 2 sqrt(1)) / 0.5 = 8 -> capped at 4: rows 4..7.
    assert roll.calls == [(1, [0, 1, 2, 3]), (2, [4, 5, 6, 7])]
    assert out.metrics == {"dynamic/rounds": 2.0, "dynamic/prompts_drawn": 8.0, "dynamic/informative_frac": 0.5,
                           "dynamic/groups": 4.0, "dynamic/target_reached": 1.0}
    assert len(out.samples) == 8 and [s.group for s in out.samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(s.reward != t.reward for s, t in zip(out.samples[::2], out.samples[1::2]))
    assert len(out.rolled) == 16 and sampler.state_dict()["offset"] == 8


def test_one_process_max_rounds_and_overlong_mask():
    """Every sample cut by the length cap leaves the loss under algo.overlong.mask: no group is informative, and
    after max_rounds the step trains on round 1's groups."""
    sampler = PromptSampler(10, 2, seed=0, shuffle=False)
    algo = AlgoConfig()
    algo.dynamic_sampling.enable, algo.dynamic_sampling.max_rounds, algo.overlong.mask = True, 3, True
    ds = DynamicSampling(algo, 2, 8, 2, sampler, None, 0, 1, "cpu")

    def roll(draw, round_):
        return Round([_sample(float(j), g, cut=True) for g in range(len(draw.local_indices)) for j in range(2)], {}, None)

    out = ds.collect(sampler.next(), roll)
    assert out.metrics["dynamic/rounds"] == 3 and out.metrics["dynamic/target_reached"] == 0.0
    assert out.metrics["dynamic/prompts_drawn"] == 6 and out.metrics["dynamic/informative_frac"] == 0.0
    assert len(out.samples) == 4  # round 1's two groups
