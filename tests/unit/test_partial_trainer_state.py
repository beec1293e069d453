"""The trainer's side of partial rollouts (sparserl/trainer/partial.py), without processes: the sampler's statistics
(what `rollout.kv.budget=auto` steers by) read only the tokens drawn in the step; the samples in flight are saved per
data-parallel rank and each rank gets its own back (the gathering and the dealing as pure functions)."""
import math

import torch

from sparserl.algo.correction_config import CorrectionConfig
from sparserl.algo.sampler_stats import SamplerStats
from sparserl.rollout.episode import Sample
from sparserl.trainer.partial import by_dp_rank, deal, fresh_mask
from sparserl.trainer.train_batch import to_train_batch

STEP, T = 5, 20


def batch_with_carried_tokens():
    """Two fresh samples (xi near 1) and two carried ones whose first 12 tokens, drawn two steps ago, have xi = e^-2."""
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(4, T, generator=g) * 3  # (B, T)
    gap = (torch.rand(4, T, generator=g) - 0.5) * 0.2  # logp_sparse - logp_old on the fresh tokens
    drawn = [[STEP] * T, [STEP] * T, [STEP - 2] * 12 + [STEP] * 8, [STEP - 2] * 12 + [STEP] * 8]
    for j in (2, 3):
        gap[j, :12] = 2.0  # stale: the policy moved since they were drawn
    samples = [Sample(0, [1, 2], list(range(3, 3 + T)), [1] * T, (logp_old[j] + gap[j]).tolist(), drawn_at=drawn[j])
               for j in range(4)]
    return samples, logp_old, gap, drawn


def stats(logp_old, batch, rows=None):
    s = SamplerStats(CorrectionConfig())
    s.add_batch(logp_old, batch, rows)
    return s.metrics(lambda t: t, "cpu")


def test_the_sampler_tail_reads_only_the_tokens_drawn_in_the_step():
    samples, logp_old, gap, drawn = batch_with_carried_tokens()
    batch = to_train_batch(samples, "cpu")
    everything = stats(logp_old, batch)
    batch.fresh_mask = fresh_mask(STEP, samples, batch)
    fresh = stats(logp_old, batch)
    # The reference: the same statistic over the fresh tokens picked straight from drawn_at.
    on = torch.tensor(drawn) == STEP
    ref = SamplerStats(CorrectionConfig())
    ref.add(logp_old, batch.logp_sparse, on.float())
    ref = ref.metrics(lambda t: t, "cpu")
    assert fresh["sampler/tokens"] == on.sum() == 56 and everything["sampler/tokens"] == 4 * T
    assert fresh["sampler/xi_p05"] == ref["sampler/xi_p05"] and fresh["sampler/xi_p01"] == ref["sampler/xi_p01"]
    exact = torch.quantile(torch.exp(-gap[on]), 0.05).item()
    assert abs(math.log(fresh["sampler/xi_p05"]) - math.log(exact)) < 0.05  # near 1: the compression's, none here
    assert everything["sampler/xi_p05"] < 0.2  # what the controller read before: the staleness
    # The fused path feeds the update's rows (an index into the batch) the same way.
    part = stats(logp_old, batch, torch.tensor([1, 3]))
    assert part["sampler/tokens"] == T + 8 and part["sampler/xi_p05"] > 0.85


def groups(tag: str, count: int) -> list[dict]:
    return [{"state": f"{tag}{i}", "started": 1, "seed": 7, "seed_index": i, "members": []} for i in range(count)]


def test_each_data_parallel_rank_gets_its_own_groups_back():
    # What every rank of a dp=2 x tp=2 run gathers: (dp rank, replica owner, open groups); tp peers hold none.
    gathered = [(0, True, groups("a", 3)), (0, False, []), (1, True, groups("b", 1)), (1, False, [])]
    state = by_dp_rank(gathered, 2)
    assert state == {"dp_size": 2, "ranks": [groups("a", 3), groups("b", 1)]}
    assert deal(state, 0, 2) == (groups("a", 3), "") and deal(state, 1, 2) == (groups("b", 1), "")
    # Another number of ranks: every group dealt anew, one line saying the run is not the uninterrupted one.
    one, note = deal(state, 0, 1)
    assert one == groups("a", 3) + groups("b", 1) and "4 groups" in note and "not as the uninterrupted run" in note
    dealt = [deal(state, r, 3)[0] for r in range(3)]
    assert sorted(g["state"] for part in dealt for g in part) == ["a0", "a1", "a2", "b0"]
    assert [len(part) for part in dealt] == [2, 1, 1]
    assert deal(by_dp_rank([(0, True, [])], 1), 0, 4) == ([], "")  # nothing in flight: nothing to say
    # A flat list (saved before the per-rank lists): dealt anew, quietly on one rank.
    assert deal(groups("a", 3), 0, 1) == (groups("a", 3), "")
    assert deal(groups("a", 3), 1, 2)[0] == groups("a", 3)[1::2] and deal(groups("a", 3), 1, 2)[1]
