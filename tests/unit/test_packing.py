"""Balanced DP partition + micro-batch packing: coverage, token bound, order restoration, balance."""
import random

import pytest

from sparserl.data.packing import (balanced_partition, flatten_plan, inverse_permutation, plan_microbatches,
                                   split_microbatches)


def lognormal_lengths(rng: random.Random, n: int) -> list[int]:
    """RL-like sequence lengths: long-tailed, clipped to 50..4000 tokens."""
    mu = rng.choice([5.5, 6.2, 6.8])  # medians of ~250, ~500, ~900 tokens
    return [min(4000, max(50, int(rng.lognormvariate(mu, 0.9)))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_bounds_restores_and_balances(seed):
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 3, 4, 8])
    n = dp * rng.choice([64, 80, 128])
    max_tokens = rng.choice([2048, 3000, 4096, 16384])
    lengths = lognormal_lengths(rng, n)
    plan = plan_microbatches(lengths, dp, max_tokens)
    assert len(plan) == dp
    order = flatten_plan(plan)
    assert sorted(order) == list(range(n))  # every sequence in exactly one micro-batch
    for rank in plan:
        for mb in rank:
            assert mb
            tokens = sum(lengths[i] for i in mb)
            assert tokens <= max_tokens or (len(mb) == 1 and lengths[mb[0]] > max_tokens), (tokens, max_tokens)
    # results computed in plan order come back in the original order
    results = [("seq", i, lengths[i]) for i in order]
    assert [results[p] for p in inverse_permutation(order)] == [("seq", i, lengths[i]) for i in range(n)]
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    mean = sum(lengths) / dp
    assert max(loads) / mean <= 1.1, (loads, mean)


def test_partition_beats_round_robin_on_a_long_tail():
    rng = random.Random(0)
    lengths = sorted(lognormal_lengths(rng, 64), reverse=True)
    parts = balanced_partition(lengths, 8)
    loads = [sum(lengths[i] for i in p) for p in parts]
    robin = [sum(lengths[r::8]) for r in range(8)]
    assert max(loads) < max(robin)
    assert max(loads) - min(loads) <= max(lengths) // 10


def test_partition_small_cases():
    assert balanced_partition([], 3) == [[], [], []]
    assert sorted(map(sorted, balanced_partition([5, 1], 3))) == [[], [0], [1]]
    lengths = [10, 1, 10, 1, 1, 1]
    assert sorted(sum(lengths[i] for i in p) for p in balanced_partition(lengths, 2)) == [12, 12]
    assert balanced_partition([3, 1, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        balanced_partition([1], 0)


def test_split_microbatches_unchanged():
    assert split_microbatches([10, 30, 20, 50], 60) == [[0, 3], [1, 2]]
    assert split_microbatches([100, 5], 50) == [[0], [1]]
    with pytest.raises(ValueError, match="max_tokens_per_device"):
        split_microbatches([1], 0)


def test_inverse_permutation_rejects_non_permutations():
    assert inverse_permutation([2, 0, 1]) == [1, 2, 0]
    with pytest.raises(ValueError):
        inverse_permutation([0, 0, 1])
    with pytest.raises(ValueError):
        inverse_permutation([0, 3])
