"""DAPO's overlong handling by hand (sparserl/algo/overlong.py) and as the trainer applies it: the penalty on the
rewards the advantages see (trainer/advantages.py) and the mask that takes cut responses out of the loss
(trainer/train_batch.py); multi-turn episodes count their last model turn."""
import pytest
import torch

from sparserl.algo.loss import LossConfig
from sparserl.algo.overlong import mask_truncated, overlong_penalty, overlong_ramp
from sparserl.config import AlgoConfig
from sparserl.rollout.episode import Sample, last_turn_len
from sparserl.trainer.advantages import set_advantages, shaped_rewards
from sparserl.trainer.train_batch import to_train_batch


def test_ramp_and_penalty_by_hand():
    # L = 20, buffer 8: 0 up to 12 tokens, then (len - 12) / 8, 1 at the cap.
    lengths = torch.tensor([0, 12, 13, 16, 19, 20])
    assert overlong_ramp(lengths, 20, 8).tolist() == [0.0, 0.0, 0.125, 0.5, 0.875, 1.0]
    assert overlong_penalty(lengths, 20, 8, 2.0).tolist() == [0.0, 0.0, 0.25, 1.0, 1.75, 2.0]
    assert overlong_penalty(lengths, 20, 8, 0.0).tolist() == [0.0] * 6
    # DAPO's form: R = (L - buffer - len) / buffer in the buffer zone.
    assert -overlong_ramp(torch.tensor([15]), 20, 8).item() == (20 - 8 - 15) / 8
    assert overlong_ramp(torch.tensor([0, 1, 2]), 2, 2).tolist() == [0.0, 0.5, 1.0]  # the buffer may be the whole cap
    with pytest.raises(ValueError):
        overlong_ramp(lengths, 20, 21)


def test_mask_truncated():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    got = mask_truncated(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] and got.dtype == mask.dtype


def _sample(reward, turns, cut, obs=2):
    """A trajectory of model turns `turns` (token counts) with `obs` env tokens between them."""
    s = Sample(group=0, prompt_ids=[1, 2, 3], reward=reward, finish_reason="length" if cut else "stop")
    for k, n in enumerate(turns):
        if k:
            s.response_ids += [9] * obs
            s.loss_mask += [0] * obs
            s.logp_sparse += [0.0] * obs
        s.response_ids += [5] * n
        s.loss_mask += [1] * n
        s.logp_sparse += [-0.5] * n
        s.turn_lens.append(n)
    return s


def test_the_trainer_penalizes_the_last_turn_and_masks_cut_samples():
    algo = AlgoConfig()
    algo.overlong.penalty, algo.overlong.buffer, algo.overlong.mask = 1.0, 4, True
    # max_new_tokens 8, ramp from 4 tokens: a multi-turn episode whose earlier turn was long is not penalized
    # for it; its last turn (6 tokens) gives 0.5.
    samples = [_sample(1.0, [8], cut=True), _sample(1.0, [3], cut=False),
               _sample(0.0, [8, 6], cut=False), _sample(0.0, [2, 7], cut=False)]
    assert [last_turn_len(s) for s in samples] == [8, 3, 6, 7]
    rewards, penalty = shaped_rewards(algo, samples, 8)
    assert penalty.tolist() == [1.0, 0.0, 0.5, 0.75]
    assert rewards.tolist() == [0.0, 1.0, -0.5, -0.75]
    batch = to_train_batch(samples, "cpu", mask_overlong=True)
    assert batch.mask.sum(-1).tolist() == [0.0, 3.0, 14.0, 9.0]
    assert to_train_batch(samples, "cpu").mask.sum(-1).tolist() == [8.0, 3.0, 14.0, 9.0]
    # The masked sample keeps its place in its group's baseline: group 0 is (0, 1) after the penalty.
    metrics = set_advantages(algo, batch, samples, 2, None, LossConfig(), max_new_tokens=8)
    adv = batch.advantages.tolist()
    assert adv[0] < 0 < adv[1] and adv[0] == pytest.approx(-adv[1])
    assert adv[2] > adv[3]  # -0.5 beats -0.75
    assert metrics["overlong/masked_frac"] == 0.25 and metrics["overlong/penalty_mean"] == pytest.approx(2.25 / 4)


def test_off_by_default():
    algo = AlgoConfig()
    samples = [_sample(1.0, [8], cut=True), _sample(0.0, [3], cut=False)]
    rewards, penalty = shaped_rewards(algo, samples, 8)
    assert rewards.tolist() == [1.0, 0.0] and penalty.tolist() == [0.0, 0.0]
    batch = to_train_batch(samples, "cpu")
    metrics = set_advantages(algo, batch, samples, 2, None, LossConfig())
    assert not any(k.startswith("overlong/") for k in metrics)
