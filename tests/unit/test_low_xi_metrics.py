"""`mismatch/low_xi_*`: the share of sampled tokens with xi = pi_old / pi_sparse < 0.1 (algo/correction.py),
hand-computed on a tiny batch, and logged the same on both trainer paths (trainer/advantages.py, loss_path.py)."""
from __future__ import annotations

import math

import pytest
import torch

from sparserl.actor.actor import TrainBatch
from sparserl.algo.aggregation import Normalizer
from sparserl.algo.correction import low_xi_metrics
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.advantages import set_advantages
from sparserl.trainer.loss_path import FusedOldLogprobLoss

F64 = torch.float64
# xi per token (logp_sparse = 0, logp_old = log xi); the mask marks response tokens (padding after them).
XI = [[0.05, 1.0, 0.5, 0.09],   # positive advantage: 0.05 and 0.09 are below 0.1
      [0.01, 1.0, 1.0, 1.0],    # positive advantage; last token is padding: 1 of 3 below
      [0.02, 0.03, 1.0, 1.0],   # negative advantage: counted only in the overall share
      [0.001, 2.0, 1.0, 1.0]]   # zero advantage: not positive; its first token masked off (env token)
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]]
ADV = [1.5, 0.2, -0.7, 0.0]


def _batch():
    xi = torch.tensor(XI, dtype=F64)
    return xi.log(), torch.zeros_like(xi), torch.tensor(MASK, dtype=F64), torch.tensor(ADV, dtype=F64)


def test_hand_example():
    logp_old, logp_sparse, mask, adv = _batch()
    m = low_xi_metrics(logp_old, logp_sparse, mask, adv)
    # positive-advantage response tokens: 4 (row 0) + 3 (row 1) = 7, of which 0.05, 0.09, 0.01 are < 0.1
    assert m["mismatch/low_xi_pos_adv_frac"] == pytest.approx(3 / 7)
    # all response tokens: 4 + 3 + 4 + 3 = 14; below 0.1: 3 above + 0.02, 0.03 (row 2); row 3's 0.001 is masked
    assert m["mismatch/low_xi_frac"] == pytest.approx(5 / 14)
    # the same with (B, 1) and (B, T) advantages
    assert low_xi_metrics(logp_old, logp_sparse, mask, adv[:, None]) == m
    assert low_xi_metrics(logp_old, logp_sparse, mask, adv[:, None].expand(-1, 4)) == m


def test_threshold_is_strict_and_reduce_sum_is_applied():
    xi = torch.tensor([[0.1, 0.0999]], dtype=F64)
    m = low_xi_metrics(xi.log(), torch.zeros_like(xi), torch.ones_like(xi), torch.tensor([1.0]))
    assert m["mismatch/low_xi_pos_adv_frac"] == pytest.approx(1 / 2)
    # a "second rank" with the same counts leaves the fractions unchanged; a reduce that adds others' counts does not
    twice = low_xi_metrics(xi.log(), torch.zeros_like(xi), torch.ones_like(xi), torch.tensor([1.0]), reduce_sum=lambda t: 2 * t)
    assert twice == m
    other = torch.zeros(4 + 5002, dtype=F64)  # the 4 counts, then the log-xi histogram's bins (mismatch/xi_p*)
    other[:4] = torch.tensor([2.0, 0.0, 2.0, 0.0], dtype=F64)  # 2 more positive tokens, none low
    shifted = low_xi_metrics(xi.log(), torch.zeros_like(xi), torch.ones_like(xi), torch.tensor([1.0]),
                             reduce_sum=lambda t: t + other)
    assert shifted["mismatch/low_xi_pos_adv_frac"] == pytest.approx(1 / 4)


def test_no_positive_tokens_and_dense_rollouts():
    logp_old, logp_sparse, mask, adv = _batch()
    m = low_xi_metrics(logp_old, logp_sparse, mask, -adv.abs())
    assert m["mismatch/low_xi_pos_adv_frac"] == 0.0
    dense = low_xi_metrics(logp_sparse, logp_sparse, mask, adv)  # xi = 1 everywhere
    assert dense == {"mismatch/low_xi_frac": 0.0, "mismatch/low_xi_pos_adv_frac": 0.0,
                     "mismatch/xi_p01": pytest.approx(1.0, rel=3e-3), "mismatch/xi_p05": pytest.approx(1.0, rel=3e-3)}


@pytest.mark.parametrize("enable", [False, True])
def test_both_trainer_paths_log_it_on_the_response_mask(enable):
    """The separate-pass path (set_advantages after the correction replaced batch.mask) and the fused path
    (FusedOldLogprobLoss.finalize) report the same numbers, taken on the uncorrected response mask."""
    logp_old, logp_sparse, mask, _ = _batch()
    rewards = [1.0, 0.5, 0.0, 0.25]  # n = 4, one group: advantages positive for the first two
    samples = [Sample(group=0, prompt_ids=[1, 2], response_ids=[3] * (4 if row[-1] else 3), loss_mask=row[: 4 if row[-1] else 3],
                      reward=r) for row, r in zip(MASK, rewards)]
    algo = AlgoConfig()
    algo.correction.enable = enable
    loss_cfg = LossConfig()

    def batch():
        return TrainBatch(ids=[s.prompt_ids + s.response_ids for s in samples], prompt_lens=[2] * 4,
                          mask=mask.float().clone(), advantages=torch.zeros(4), logp_sparse=logp_sparse.float())

    separate = batch()
    separate.logp_old = logp_old.float()
    separate.mask = torch.zeros_like(separate.mask)  # as if the correction had masked everything
    m_sep = set_advantages(algo, separate, samples, 4, torch.zeros(4, dtype=torch.bool), loss_cfg)

    fused = batch()
    set_advantages(algo, fused, samples, 4, None, loss_cfg)
    assert torch.equal(fused.advantages, separate.advantages)
    assert (fused.advantages[:2] > 0).all() and (fused.advantages[2:] <= 0).all()
    loss_fn = FusedOldLogprobLoss(algo, loss_cfg, None)
    loss_fn._logp_old = logp_old.float()  # what the update's forward would have recorded
    loss_fn.finalize(fused, [0, 1, 2, 3], Normalizer(tokens=14.0, seqs=4.0))

    for m in (m_sep, loss_fn.metrics):
        assert m["mismatch/low_xi_pos_adv_frac"] == pytest.approx(3 / 7)
        assert m["mismatch/low_xi_frac"] == pytest.approx(5 / 14)
    assert math.isfinite(loss_fn.metrics["mismatch/kl"])


def test_the_tail_covers_every_sampled_token_on_every_path_with_overlong_masking():
    """With `algo.overlong.mask`, a length-cut sample leaves the loss but not the sampler's tail: the separate pass
    (set_advantages), the fused path (FusedOldLogprobLoss.finalize) and the sampler's record
    (SamplerStats) count the same tokens, all of them."""
    from sparserl.algo.sampler_stats import SamplerStats
    from sparserl.trainer.train_batch import to_train_batch

    xi = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.2, 0.3, 0.4, 0.25], [1.0, 1.0, 0.9, 1.0], [1.0, 1.1, 1.0, 1.0]])
    samples = [Sample(group=0, prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], loss_mask=[1, 1, 1, 1],
                      logp_sparse=[0.0] * 4, reward=float(i % 2), finish_reason="length" if i == 1 else "stop")
               for i in range(4)]  # sample 1, cut by the length cap, carries the low tail
    algo = AlgoConfig()
    algo.overlong.mask = True
    loss_cfg = LossConfig()
    separate = to_train_batch(samples, "cpu", mask_overlong=True)
    assert separate.mask[1].sum() == 0 and separate.response_mask[1].sum() == 4
    separate.logp_old = xi.log()
    m_sep = set_advantages(algo, separate, samples, 4, torch.zeros(4, dtype=torch.bool), loss_cfg)

    fused = to_train_batch(samples, "cpu", mask_overlong=True)
    set_advantages(algo, fused, samples, 4, None, loss_cfg)
    sampled = SamplerStats(algo.correction)
    loss_fn = FusedOldLogprobLoss(algo, loss_cfg, None, sampled)
    loss_fn._logp_old = xi.log()  # what the update's forward would have recorded
    loss_fn.finalize(fused, [0, 1, 2, 3], Normalizer(tokens=12.0, seqs=3.0))
    m_sampler = sampled.metrics(lambda t: t, "cpu")

    want = low_xi_metrics(xi.log(), torch.zeros_like(xi), torch.ones_like(xi), torch.zeros(4))  # all 16 tokens
    assert want["mismatch/xi_p05"] < 0.3  # the cut sample's tokens are the tail
    for name in ("mismatch/xi_p05", "mismatch/xi_p01"):
        assert m_sep[name] == loss_fn.metrics[name] == want[name], name
        assert m_sampler[name.replace("mismatch/", "sampler/")] == want[name], name
    assert m_sampler["sampler/tokens"] == 16 and m_sampler["sampler/seqs"] == 4
