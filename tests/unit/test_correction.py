import math

import pytest
import torch

from sparserl.algo.aggregation import count_normalizer
from sparserl.algo.correction import correct
from sparserl.algo.correction_config import CorrectionConfig
from sparserl.algo.loss import LossConfig, policy_objective

F64 = torch.float64


def _from_xi(xi_rows, mask_rows):
    """logp_sparse = 0 and logp_old = log(xi): the sparsity ratio is xi exactly."""
    xi = torch.tensor(xi_rows, dtype=F64)
    return xi.log(), torch.zeros_like(xi), torch.tensor(mask_rows, dtype=F64)


def _paper_batch():
    return _from_xi(
        [[1.0, 1.2, 2.0, 0.8],     # 2.0 > token_high: that token is masked
         [1e-5, 1.0, 1.0, 1.0],    # one token below the veto: the whole sequence is rejected
         [0.4, 1.4, 1.0, 1.0]],    # 0.4 < token_low: masked; last token is padding
        [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]],
    )


def test_paper_config_hand_example():
    logp_old, logp_sparse, mask = _paper_batch()
    corr, metrics = correct(CorrectionConfig(), logp_old, logp_sparse, mask)
    assert corr.seq_rejected.tolist() == [False, True, False]
    expected_mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=F64)
    assert torch.equal(corr.mask, expected_mask)
    # surviving raw weights 1.0, 1.2, 0.8, 1.4, 1.0: mean 5.4 / 5 = 1.08
    m = 1.08
    expected_w = torch.tensor([[1 / m, 1.2 / m, 1, 0.8 / m], [1, 1, 1, 1], [1, 1.4 / m, 1 / m, 1]], dtype=F64)
    torch.testing.assert_close(corr.weights, expected_w)
    assert corr.weights[corr.mask > 0].mean().item() == pytest.approx(1.0)
    assert not corr.weights.requires_grad
    # 10 response tokens, 3 sequences
    assert metrics["correction/masked_low_frac"] == pytest.approx(2 / 10)  # 0.4 and 1e-5
    assert metrics["correction/masked_high_frac"] == pytest.approx(1 / 10)
    assert metrics["correction/rejected_seq_frac"] == pytest.approx(1 / 3)
    assert metrics["correction/veto_seq_frac"] == pytest.approx(1 / 3)
    assert metrics["correction/kept_token_frac"] == pytest.approx(5 / 10)
    assert metrics["correction/truncated_frac"] == 0.0
    assert metrics["correction/norm_factor"] == pytest.approx(m)
    assert metrics["correction/weight_mean"] == pytest.approx(1.0)
    assert metrics["correction/weight_min"] == pytest.approx(0.8 / m)
    assert metrics["correction/weight_max"] == pytest.approx(1.4 / m)
    w = torch.tensor([1.0, 1.2, 0.8, 1.4, 1.0], dtype=F64)
    assert metrics["correction/ess"] == pytest.approx((w.sum() ** 2 / (5 * (w * w).sum())).item())
    assert corr.metrics is metrics and all(isinstance(v, float) for v in metrics.values())
    assert corr.kl_weights is None


def test_truncation_never_exceeds_cap_before_renormalization():
    logp_old, logp_sparse, mask = _paper_batch()
    cfg = CorrectionConfig(token_high=None, is_batch_normalize=False)
    corr, metrics = correct(cfg, logp_old, logp_sparse, mask)
    assert corr.weights[0].tolist() == pytest.approx([1.0, 1.2, 1.5, 0.8])  # xi = 2.0 capped at 1.5
    assert corr.weights.max().item() <= 1.5
    assert metrics["correction/truncated_frac"] == pytest.approx(1 / 10)
    assert metrics["correction/weight_max"] == pytest.approx(1.5)


def test_renormalized_max_can_exceed_cap_but_not_cap_over_token_low():
    # surviving xi are small, so the mean weight m < 1 and the renormalized max is cap / m > cap
    logp_old, logp_sparse, mask = _from_xi([[0.6, 0.6, 0.6, 3.0]], [[1, 1, 1, 1]])
    corr, metrics = correct(CorrectionConfig(token_high=None), logp_old, logp_sparse, mask)
    m = (0.6 * 3 + 1.5) / 4
    assert corr.weights.max().item() == pytest.approx(1.5 / m)
    assert 1.5 < corr.weights.max().item() <= 1.5 / 0.5


def test_token_mask_bounds():
    logp_old, logp_sparse, mask = _from_xi([[0.5001, 1.4999, 0.4999, 1.5001]], [[1, 1, 1, 1]])
    corr, _ = correct(CorrectionConfig(veto=None), logp_old, logp_sparse, mask)
    assert corr.mask.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert corr.seq_rejected.tolist() == [False]


def test_geometric_filter():
    cfg = CorrectionConfig(veto=None, token_low=None, token_high=None, is_cap=None, geo_low=0.9, geo_high=1.1)
    logp_old, logp_sparse, mask = _from_xi(
        [[2.0, 0.5, 1.0], [1.5, 1.5, 1.0], [0.8, 0.8, 5.0]],  # geometric means 1, 1.5, 0.8 (pad excluded)
        [[1, 1, 0], [1, 1, 0], [1, 1, 0]],
    )
    corr, metrics = correct(cfg, logp_old, logp_sparse, mask)
    assert corr.seq_rejected.tolist() == [False, True, True]
    assert corr.mask.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert torch.equal(corr.weights, torch.ones(3, 3, dtype=F64))  # is_cap=None: no reweighting
    assert metrics["correction/geo_rejected_seq_frac"] == pytest.approx(2 / 3)


def test_mismatch_metrics_hand_example_with_correction_off():
    logp_old = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64)
    logp_sparse = torch.tensor([[-1.5, -1.0, float("nan")]], dtype=F64)  # padding may hold garbage
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    corr, metrics = correct(CorrectionConfig(enable=False), logp_old, logp_sparse, mask)
    assert metrics["mismatch/kl"] == pytest.approx((-0.5 + 1.0) / 2)
    assert metrics["mismatch/abs_mean"] == pytest.approx(0.75)
    assert metrics["mismatch/abs_max"] == pytest.approx(1.0)
    assert metrics["mismatch/k3_kl"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(-1) - 1 + 1)) / 2)
    assert metrics["mismatch/log_ppl_sparse"] == pytest.approx(1.25)
    assert metrics["mismatch/log_ppl_dense"] == pytest.approx(1.5)
    assert metrics["mismatch/log_ppl_diff"] == pytest.approx(-0.25)
    assert not any(k.startswith("correction/") for k in metrics)
    assert torch.equal(corr.weights, torch.ones(1, 3, dtype=F64))
    assert torch.equal(corr.mask, mask)


def test_measure_mode_changes_nothing():
    logp_old, logp_sparse, mask = _paper_batch()
    applied, m_apply = correct(CorrectionConfig(), logp_old, logp_sparse, mask)
    corr, m_measure = correct(CorrectionConfig(mode="measure", apply_to_kl=True), logp_old, logp_sparse, mask)
    assert torch.equal(corr.weights, torch.ones_like(mask))
    assert torch.equal(corr.mask, mask)
    assert not corr.seq_rejected.any()
    assert corr.kl_weights is None
    assert m_measure == m_apply  # it reports what "apply" would do
    assert m_measure["correction/rejected_seq_frac"] > 0


def test_apply_to_kl_hands_out_the_weights():
    corr, _ = correct(CorrectionConfig(apply_to_kl=True), *_paper_batch())
    assert corr.kl_weights is corr.weights


def test_fully_rejected_batch_gives_zero_loss_and_no_nan():
    logp_old, logp_sparse, mask = _from_xi([[1e-6, 1.0], [1.0, 1e-9]], [[1, 1], [1, 1]])
    corr, metrics = correct(CorrectionConfig(), logp_old, logp_sparse, mask)
    assert corr.seq_rejected.all()
    assert torch.equal(corr.mask, torch.zeros_like(mask))
    assert torch.equal(corr.weights, torch.ones_like(mask))
    assert all(math.isfinite(v) for v in metrics.values())
    logp = (logp_old + 0.1).requires_grad_(True)
    norm = count_normalizer([corr.mask])
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, lm = policy_objective(cfg, logp, logp_old, torch.ones(2, 1, dtype=F64), corr.mask, norm,
                                weights=corr.weights, logp_ref=logp_old, entropy=logp.exp())
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(math.isfinite(v) for v in lm.values())


def test_dense_rollouts_are_a_no_op():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 20
    logp_old = -3 * torch.rand(B, T, generator=g)
    logp_sparse = logp_old + 1e-7 * torch.randn(B, T, generator=g)
    mask = (torch.arange(T)[None] < torch.randint(5, T + 1, (B, 1), generator=g)).float()
    corr, metrics = correct(CorrectionConfig(), logp_old, logp_sparse, mask)
    assert (corr.weights - 1).abs().max().item() < 1e-4
    assert not corr.seq_rejected.any()
    assert torch.equal(corr.mask, mask)
    assert metrics["mismatch/abs_max"] < 1e-5

    logp = logp_old + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g)
    norm = count_normalizer([mask])
    for agg in ("token", "sequence"):
        cfg = LossConfig(loss_agg=agg)
        plain, _ = policy_objective(cfg, logp, logp_old, adv, mask, norm)
        fixed, _ = policy_objective(cfg, logp, logp_old, adv, corr.mask, norm, weights=corr.weights)
        assert fixed.item() == pytest.approx(plain.item(), rel=1e-6)


def test_sequence_without_response_tokens():
    logp_old, logp_sparse, mask = _from_xi([[1.0, 1.0], [1e-6, 1.0]], [[1, 1], [0, 0]])
    corr, metrics = correct(CorrectionConfig(), logp_old, logp_sparse, mask)
    assert corr.seq_rejected.tolist() == [False, False]  # masked tokens never trigger the veto
    assert metrics["correction/rejected_seq_frac"] == 0.0
    assert metrics["mismatch/log_ppl_dense"] == pytest.approx(0.0)


def test_config_and_shape_errors():
    with pytest.raises(ValueError, match="algo.correction.mode"):
        CorrectionConfig(mode="apply_all")
    with pytest.raises(ValueError, match="token_low"):
        CorrectionConfig(token_low=2.0, token_high=1.5)
    with pytest.raises(ValueError, match="is_cap"):
        CorrectionConfig(is_cap=-1.0)
    with pytest.raises(ValueError, match="same"):
        correct(CorrectionConfig(), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("normalize_over", ["kept", "all"])
def test_normalize_over_kept_vs_all_hand_example(normalize_over):
    """`kept` divides by the mean capped weight of the surviving tokens; `all` (verl / slime) by the mean over every
    response token, before the veto and the token band remove any."""
    logp_old, logp_sparse, mask = _paper_batch()
    corr, metrics = correct(CorrectionConfig(normalize_over=normalize_over), logp_old, logp_sparse, mask)
    # capped xi of all 10 response tokens: 1, 1.2, 1.5 (2.0 capped), 0.8 | 1e-5, 1, 1 | 0.4, 1.4, 1
    m = 5.4 / 5 if normalize_over == "kept" else (4.5 + 2.00001 + 2.8) / 10
    assert corr.norm_factor == pytest.approx(m) and metrics["correction/norm_factor"] == pytest.approx(m)
    assert corr.kept_tokens == 5.0
    expected_mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=F64)
    assert torch.equal(corr.mask, expected_mask)  # rejection and masking do not depend on the normalization
    expected_w = torch.tensor([[1 / m, 1.2 / m, 1, 0.8 / m], [1, 1, 1, 1], [1, 1.4 / m, 1 / m, 1]], dtype=F64)
    torch.testing.assert_close(corr.weights, expected_w)
    # token-mean PPO loss at ratio 1: -sum(A_i * w_t) over kept tokens / 5 kept tokens
    adv = torch.tensor([[1.0], [-1.0], [0.5]], dtype=F64)
    norm = count_normalizer([corr.mask])
    loss, _ = policy_objective(LossConfig(), logp_old.clone(), logp_old, adv, corr.mask, norm, weights=corr.weights)
    expected = -(1.0 * (1 + 1.2 + 0.8) + 0.5 * (1.4 + 1.0)) / m / 5
    assert loss.item() == pytest.approx(expected)
    if normalize_over == "all":  # the surviving weights no longer average 1
        assert corr.weights[corr.mask > 0].mean().item() == pytest.approx(1.08 / m)
