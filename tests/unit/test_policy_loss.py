import math

import pytest
import torch

from sparserl.algo.policy_loss import POLICY_LOSSES, ppo_clip


def _run(ratios, advs, mask=None, fn=ppo_clip, logp_old=-1.0, **kw):
    """Per-token losses and d loss_sum / d logp for tokens with the given ratios r = exp(logp - logp_old)."""
    r = torch.tensor([ratios], dtype=torch.float64)
    old = torch.full_like(r, logp_old)
    logp = (old + r.log()).requires_grad_(True)
    adv = torch.tensor([advs], dtype=torch.float64)
    mask = torch.ones_like(r) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = fn(logp, old, adv, mask, **kw)
    loss.sum().backward()
    return loss.detach()[0].tolist(), logp.grad[0].tolist(), metrics


def test_clip_cases_values_and_gradients():
    # (r, A): r above 1+eps with A>0 (clipped), below 1-eps with A<0 (clipped),
    # above with A<0 and below with A>0 (unclipped: pessimistic side), inside the range.
    loss, grad, m = _run([1.5, 0.5, 1.5, 0.5, 1.1], [1.0, -1.0, -1.0, 1.0, 2.0])
    assert loss == pytest.approx([-1.2, 0.8, 1.5, -0.5, -2.2])
    # d(-A r)/dlogp = -A r on the unclipped branch, 0 on the clipped one
    assert grad == pytest.approx([0.0, 0.0, 1.5, -0.5, -2.2])
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["clip_frac_high"] == pytest.approx(1 / 5)
    assert m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)
    k3 = lambda x: x - 1 - math.log(x)  # noqa: E731
    assert m["approx_kl"] == pytest.approx((2 * k3(1.5) + 2 * k3(0.5) + k3(1.1)) / 5)
    # 0-dim tensors on the loss's device (no host read here); policy_objective reads them back, or not at all
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())


def test_clip_higher_is_asymmetric():
    # symmetric 0.2: r=1.25 with A>0 is clipped
    loss, grad, _ = _run([1.25, 0.75], [1.0, -1.0], clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx([-1.2, 0.8]) and grad == pytest.approx([0.0, 0.0])
    # clip-higher 0.28 lets r=1.25 through, the low side is unchanged
    loss, grad, m = _run([1.25, 0.75], [1.0, -1.0], clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx([-1.25, 0.8])
    assert grad == pytest.approx([-1.25, 0.0])
    assert m["clip_frac_high"] == 0.0 and m["clip_frac_low"] == 0.5


def test_dual_clip_bounds_negative_advantages():
    loss, grad, m = _run([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], dual_clip=3.0)
    # r=5, A=-1: max(5, 1.2) = 5 > 3 -> 3, no gradient; r=2: 2 < 3 untouched; A>0 unaffected
    assert loss == pytest.approx([3.0, 2.0, -1.2])
    assert grad == pytest.approx([0.0, 2.0, 0.0])
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    loss, grad, _ = _run([5.0], [-1.0])
    assert loss == pytest.approx([5.0]) and grad == pytest.approx([5.0])
    with pytest.raises(ValueError, match="dual_clip"):
        _run([1.0], [1.0], dual_clip=1.0)


def test_metrics_respect_mask_and_adv_broadcast():
    r = torch.tensor([[1.5, 1.0, 1.0]], dtype=torch.float64)
    logp = r.log().requires_grad_(True)
    adv = torch.tensor([[1.0]], dtype=torch.float64)  # (B, 1) broadcast over tokens
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    loss, m = ppo_clip(logp, torch.zeros_like(r), adv, mask)
    assert loss.shape == (1, 3)
    assert loss.detach()[0].tolist() == pytest.approx([-1.2, -1.0, -1.0])
    assert m["clip_frac"] == 0.0  # the clipped token is masked out
    assert m["ratio_mean"] == pytest.approx(1.0)


def test_extreme_log_ratio_is_clamped():
    logp = torch.tensor([[100.0]], requires_grad=True)
    loss, _ = ppo_clip(logp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-5)


def test_cispo_passes_gradient_through_clipped_tokens():
    # loss = -clip(r) A logp with clip(r) detached: grad = -clip(r) A
    loss, grad, m = _run([1.5, 1.0], [1.0, -2.0], fn=POLICY_LOSSES["cispo"], logp_old=-1.0)
    logp = [-1.0 + math.log(1.5), -1.0]
    assert loss == pytest.approx([-1.2 * logp[0], 2.0 * logp[1]])
    assert grad == pytest.approx([-1.2, 2.0])
    assert m["clip_frac_high"] == 0.5
    with pytest.raises(ValueError):
        _run([1.0], [1.0], fn=POLICY_LOSSES["cispo"], dual_clip=3.0)


def test_registry():
    assert POLICY_LOSSES["ppo"] is ppo_clip
