import math

import pytest
import torch

from sparserl.algo.advantages import compute_advantages


def _rewards():
    # group 0: mean 0.5, sample std sqrt(1/3); group 1: mean 3, sample std sqrt(14/3)
    return torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)


def test_grpo_hand_example():
    adv, metrics = compute_advantages("grpo", _rewards(), eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(14 / 3)
    expected = torch.tensor([[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0],
                             [-2 / s1, -1 / s1, 0.0, 3 / s1]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    assert abs(expected[0, 0].item() - 0.8660254) < 1e-6  # sample (Bessel) std, not population std
    assert isinstance(metrics["adv/mean"], float)


def test_grpo_eps_in_denominator():
    adv, _ = compute_advantages("grpo", _rewards(), eps=0.1)
    assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 0.1))


def test_drgrpo_hand_example():
    adv, _ = compute_advantages("drgrpo", _rewards())
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-2.0, -1.0, 0.0, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("name", ["grpo", "drgrpo"])
def test_zero_std_group_is_exactly_zero(name):
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0]], dtype=torch.float32)
    adv, metrics = compute_advantages(name, rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    assert (adv[1] != 0).all()
    assert metrics["adv/zero_std_group_frac"] == 0.5


def test_invalid_members():
    rewards = torch.tensor([[1.0, 0.0, 5.0, 1.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False, True]])
    # valid members {1, 0, 1}: mean 2/3, sample std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3)
    adv, metrics = compute_advantages("grpo", rewards, valid, eps=0.0)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s]], dtype=torch.float64))
    adv, _ = compute_advantages("drgrpo", rewards, valid)
    torch.testing.assert_close(adv, torch.tensor([[1 / 3, -2 / 3, 0.0, 1 / 3]], dtype=torch.float64))
    assert metrics["adv/valid_frac"] == 0.75


def test_single_valid_member_gets_zero():
    rewards = torch.tensor([[3.0, 0.0, 1.0]])
    valid = torch.tensor([[True, False, False]])
    adv, _ = compute_advantages("grpo", rewards, valid)
    assert torch.equal(adv, torch.zeros(1, 3))


def test_integer_rewards_and_errors():
    adv, _ = compute_advantages("drgrpo", torch.tensor([[1, 0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5]]))
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages("nope", _rewards())
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("grpo", torch.ones(4))
