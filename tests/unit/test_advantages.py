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


# ---------------------------------------------------------------------------------------------------- RLOO
def test_rloo_hand_example_invalid_members_and_ties():
    adv, metrics = compute_advantages("rloo", _rewards())
    # r_i - mean of the 3 others: group 0 (1, 0, 0, 1), group 1 (1, 2, 3, 6)
    expected = torch.tensor([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3],
                             [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    # = k / (k - 1) x Dr.GRPO's advantage
    torch.testing.assert_close(adv, compute_advantages("drgrpo", _rewards())[0] * 4 / 3)
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-12)
    # an invalid member is neither scored nor in the others' baseline; a tie or a lone valid member gives 0
    rewards = torch.tensor([[1.0, 0.0, 5.0, 1.0], [0.3, 0.3, 0.3, 0.3], [2.0, 7.0, 1.0, 1.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False, True], [True] * 4, [True, False, False, False]])
    adv, _ = compute_advantages("rloo", rewards, valid)
    torch.testing.assert_close(adv, torch.tensor([[1 - 1 / 2, 0 - 1, 0, 1 - 1 / 2], [0.0] * 4, [0.0] * 4],
                                                 dtype=torch.float64))
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))  # exactly


# ---------------------------------------------------------------------------------------------- REINFORCE++
def ragged_batch():
    """Two groups of 3 in float64: a plain response, a multi-turn one (env tokens 2-3 off the mask), one cut by the
    length cap (all-zero mask), one rejected (invalid; its mask left as it was), a one-token response. Per-token
    rewards (the negated KL penalty) are non-zero off the mask too: the estimator must ignore them there."""
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.5, 2.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True], [True, False, True]])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    token_rewards = -0.1 * torch.rand(6, 6, generator=g, dtype=torch.float64)
    return rewards, valid, mask, token_rewards


def hand_reinforce_pp(rewards, valid, mask, token_rewards, baseline, eps=1e-6):
    """REINFORCE++ by loops: returns G_t = r + sum of the masked per-token rewards from t on, whitened over the masked
    tokens of valid rows (sample std)."""
    G, n = rewards.shape
    r = rewards.tolist()
    if baseline:
        for g in range(G):
            members = [r[g][j] for j in range(n) if valid[g, j]]
            mean = sum(members) / len(members)
            r[g] = [x - mean for x in r[g]]
    flat = [x for row in r for x in row]
    B, T = mask.shape
    ret = [[0.0] * T for _ in range(B)]
    counted = []
    for i in range(B):
        for t in range(T):
            if mask[i, t] > 0:
                ret[i][t] = flat[i] + sum(token_rewards[i, s].item() for s in range(t, T) if mask[i, s] > 0)
                if valid.reshape(-1)[i]:
                    counted.append(ret[i][t])
    mean = sum(counted) / len(counted)
    std = math.sqrt(sum((x - mean) ** 2 for x in counted) / (len(counted) - 1))
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if mask[i, t] > 0 and valid.reshape(-1)[i]:
                out[i, t] = (ret[i][t] - mean) / (std + eps)
    return out


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_against_a_hand_computation(name):
    rewards, valid, mask, token_rewards = ragged_batch()
    adv, metrics = compute_advantages(name, rewards, valid, mask=mask, token_rewards=token_rewards)
    expected = hand_reinforce_pp(rewards, valid, mask, token_rewards, baseline=name.endswith("baseline"))
    assert adv.shape == mask.shape and adv.dtype == torch.float64
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(adv[2], torch.zeros(6, dtype=torch.float64)) and torch.equal(adv[4], torch.zeros(6, dtype=torch.float64))
    assert (adv[1, 2:4] == 0).all() and (adv[1, [0, 1, 4, 5]] != 0).all()  # env tokens get nothing
    # whitened over the counted tokens: mean 0, sample std 1 (up to eps)
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-12)
    counted = expected[(mask > 0) & valid.reshape(-1, 1)]
    assert counted.std().item() == pytest.approx(1.0, rel=1e-5)
    # without per-token rewards the returns are the (centred) reward on every token: one value per sequence
    adv, _ = compute_advantages(name, rewards, valid, mask=mask)
    torch.testing.assert_close(adv, hand_reinforce_pp(rewards, valid, mask, torch.zeros_like(mask),
                                                      baseline=name.endswith("baseline")), rtol=1e-12, atol=1e-12)


def test_reinforce_pp_keeps_a_tied_group_and_the_baseline_variant_centres_it():
    rewards = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.float64)
    plain, _ = compute_advantages("reinforce_pp", rewards, mask=mask)
    assert (plain[:2] > 0).all()  # the tied group's reward is above the batch's
    base, _ = compute_advantages("reinforce_pp_baseline", rewards, mask=mask)
    # the tied group's centred reward is exactly 0; whitening shifts it by minus the batch mean of the centred returns
    # over the std, and that mean is 0 here (0 x 6 tokens, +0.5 x 3, -0.5 x 3), so it stays exactly 0
    assert torch.equal(base[:2], torch.zeros(2, 3, dtype=torch.float64))
    assert (base[2] > 0).all() and (base[3] < 0).all()


def test_group_estimators_sum_the_per_token_rewards_into_the_sequence_reward():
    rewards, valid, mask, token_rewards = ragged_batch()
    token_rewards = token_rewards * mask
    for name in ("grpo", "drgrpo", "rloo"):
        adv, _ = compute_advantages(name, rewards, valid, mask=mask, token_rewards=token_rewards)
        summed, _ = compute_advantages(name, rewards + token_rewards.sum(-1).view(2, 3), valid)
        assert adv.shape == (2, 3) and torch.equal(adv, summed)


def test_per_token_estimators_need_the_mask_and_signal_rules():
    from sparserl.algo.advantages import ADV_ESTIMATORS, reward_signal
    from sparserl.config.relations import PER_TOKEN_ESTIMATORS

    assert {k for k, e in ADV_ESTIMATORS.items() if e.per_token} == set(PER_TOKEN_ESTIMATORS)
    with pytest.raises(ValueError, match="per token"):
        compute_advantages("reinforce_pp", _rewards())
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 1.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    for name in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        # a tie carries no reward signal; neither does a reward equal to its group's mean (0.5 of {0, 0.5, 1})
        assert reward_signal(name, rewards).tolist() == [[False] * 3, [True, False, True]], name
        assert reward_signal(name, rewards, valid).tolist() == [[False] * 3, [True, True, False]], name
    assert reward_signal("reinforce_pp", rewards, valid).tolist() == valid.tolist()
