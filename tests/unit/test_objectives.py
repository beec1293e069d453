"""The objectives as the trainer wires them (trainer/advantages.py, trainer/loss.py, trainer/loss_path.py,
trainer/balance.py): REINFORCE++ with the KL penalty per token in the reward, its whitening over the loss tokens the
correction keeps, the per-token advantages through rank balancing and zero-advantage skipping, the presets and the
config errors of the new estimators and losses."""
import dataclasses

import pytest
import torch

from sparserl.algo.advantages import compute_advantages, zero_advantage
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.config.load import load_config
from sparserl.rollout.episode import Sample
from sparserl.trainer.advantages import set_advantages
from sparserl.trainer.balance import _records, _to_batch
from sparserl.trainer.loss import apply_correction, loss_config
from sparserl.trainer.loss_path import fused_old_logprobs
from sparserl.trainer.train_batch import to_train_batch
from sparserl.utils.errors import UserError
from tests.unit.test_advantages import hand_reinforce_pp


def _sample(reward, turns, obs=2, cut=False):
    """Model turns of `turns` tokens each with `obs` env tokens between them."""
    s = Sample(group=0, prompt_ids=[1, 2, 3], reward=reward, finish_reason="length" if cut else "stop")
    for k, n in enumerate(turns):
        if k:
            s.response_ids += [9] * obs
            s.loss_mask += [0] * obs
            s.logp_sparse += [0.0] * obs
        s.response_ids += [5 + k] * n
        s.loss_mask += [1] * n
        s.logp_sparse += [-0.5] * n
        s.turn_lens.append(n)
    return s


def _batch(samples, mask_overlong=False):
    batch = to_train_batch(samples, "cpu", mask_overlong)
    g = torch.Generator().manual_seed(5)
    shape = batch.mask.shape
    batch.logp_old = batch.logp_sparse + 0.05 * torch.randn(shape, generator=g)
    batch.logp_ref = batch.logp_old + 0.3 * torch.randn(shape, generator=g)
    return batch


SAMPLES = [_sample(1.0, [3]), _sample(0.0, [2, 2]), _sample(1.0, [4], cut=True),  # group 0
           _sample(0.0, [5]), _sample(1.0, [1, 3]), _sample(1.0, [2])]  # group 1


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_takes_the_kl_penalty_per_token(name):
    algo = AlgoConfig(adv_estimator=name)
    algo.overlong.mask = True
    algo.kl.coef, algo.kl.estimator, algo.kl.mode = 0.2, "k1", "reward"
    batch = _batch(SAMPLES, mask_overlong=True)
    metrics = set_advantages(algo, batch, SAMPLES, 3, None, loss_config(algo))
    # k1 per token: coef x (logp_old - logp_ref) on the loss tokens, subtracted from each token's reward
    token_rewards = -0.2 * (batch.logp_old - batch.logp_ref) * batch.mask
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    want = hand_reinforce_pp(rewards, torch.ones(2, 3, dtype=torch.bool), batch.mask.double(), token_rewards.double(),
                             baseline=name.endswith("baseline"))
    assert batch.advantages.shape == batch.mask.shape
    torch.testing.assert_close(batch.advantages.double(), want, rtol=1e-5, atol=1e-5)
    assert (batch.advantages[2] == 0).all()  # cut by the length cap: out of the loss and of the statistics
    assert (batch.advantages[1, 2:4] == 0).all() and (batch.advantages[1, [0, 1, 4, 5]] != 0).all()
    assert metrics["reward/kl"] != 0 and abs(metrics["adv/mean"]) < 1e-6
    # a group estimator with the same settings sums the penalty into the sequence's reward, as before
    grpo = dataclasses.replace(algo, adv_estimator="grpo")
    set_advantages(grpo, batch, SAMPLES, 3, None, loss_config(grpo))
    penalty = (0.2 * (batch.logp_old - batch.logp_ref) * batch.mask).sum(-1)
    seq_rewards = torch.tensor([s.reward for s in SAMPLES]) - penalty
    assert torch.equal(batch.advantages, compute_advantages("grpo", seq_rewards.view(2, 3))[0].reshape(-1))


def test_rejected_sequences_stay_out_of_the_whitening():
    algo = AlgoConfig(adv_estimator="reinforce_pp")
    algo.correction = dataclasses.replace(algo.correction, enable=True, mode="apply", token_low=None, token_high=None)
    batch = _batch(SAMPLES)
    batch.logp_old[4, 0] = batch.logp_sparse[4, 0] - 12.0  # xi = e^-12 < veto: sequence 4 is rejected
    uncorrected = batch.mask.clone()
    rejected, _ = apply_correction(algo, batch, None)
    assert rejected.tolist() == [False, False, False, False, True, False]
    set_advantages(algo, batch, SAMPLES, 3, rejected, loss_config(algo))
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    valid = torch.ones(2, 3, dtype=torch.bool)
    want = hand_reinforce_pp(rewards, valid, batch.mask.double(), torch.zeros(6, batch.mask.shape[1], dtype=torch.float64),
                             baseline=False)
    torch.testing.assert_close(batch.advantages.double(), want, rtol=1e-5, atol=1e-6)
    assert (batch.advantages[4] == 0).all()
    with_rejected = hand_reinforce_pp(rewards, valid, uncorrected.double(), torch.zeros_like(want), baseline=False)
    assert not torch.allclose(want[0], with_rejected[0])  # counting it would have moved every other advantage
    # the fused path cannot know the rejections before the update: it is refused for this estimator
    cfg = load_config(["algo.adv_estimator=reinforce_pp", "algo.correction.enable=true"])
    assert not fused_old_logprobs(cfg)[0] and "whitened over the loss tokens" in fused_old_logprobs(cfg)[1]
    assert fused_old_logprobs(load_config(["algo.adv_estimator=reinforce_pp"]))[0]
    assert fused_old_logprobs(load_config(["+preset=[gspo,sparse_rl]"]))[0]


def test_per_token_advantages_survive_rank_balancing_and_zero_advantage_skipping():
    algo = AlgoConfig(adv_estimator="reinforce_pp_baseline")
    batch = _batch(SAMPLES)
    set_advantages(algo, batch, SAMPLES, 3, None, loss_config(algo))
    moved = _to_batch(_records(batch, [list(range(6))], ["mask", "logp_old"], 0), {"mask": torch.float32,
                      "logp_old": torch.float32}, "cpu", per_token_adv=True)
    assert torch.equal(moved.advantages, batch.advantages) and torch.equal(moved.mask, batch.mask)
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    assert zero_advantage(adv).tolist() == [True, False, True]
    assert zero_advantage(torch.tensor([0.0, -1.0])).tolist() == [True, False]


def test_presets_compose_and_bad_pairs_are_one_line():
    gspo = load_config(["+preset=[gspo,sparse_rl]"])
    a = gspo.algo
    assert (a.policy_loss, a.clip_low, a.clip_high, a.loss_agg, a.adv_estimator) == ("gspo", 3e-4, 4e-4, "sequence", "grpo")
    assert a.correction.enable and gspo.rollout.kv.algorithm == "rkv"
    rloo = load_config(["+preset=[rloo,sparse_rl]", "rollout.n=4"])
    assert rloo.algo.adv_estimator == "rloo" and rloo.algo.correction.enable
    with pytest.raises(UserError, match=r"algo.adv_estimator=rloo with rollout.n=1: .*rollout.n >= 2"):
        load_config(["+preset=rloo", "rollout.n=1"])
    with pytest.raises(UserError, match=r"algo.policy_loss=gspo takes one advantage per sequence.*gspo_token"):
        load_config(["+preset=gspo", "algo.adv_estimator=reinforce_pp", "algo.kl.coef=0.01", "algo.kl.mode=reward"])
    load_config(["algo.policy_loss=gspo_token", "algo.adv_estimator=reinforce_pp", "algo.kl.coef=0.01",
                 "algo.kl.mode=reward"])
    with pytest.raises(UserError, match="dual_clip"):
        load_config(["+preset=gspo", "algo.dual_clip=3"])
    assert LossConfig(policy_loss="gspo_token").policy_loss == "gspo_token"
