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


# ------------------------------------------------------------------------------------------------------ GSPO
CL, CH = 3e-4, 4e-4
# Per row: (mean log-ratio over its loss tokens, advantage). Row 0 inside the range, row 1 clipped below with A < 0,
# row 2 clipped above with A > 0 (both: no gradient), row 3 below the range with A > 0 (the pessimistic, unclipped
# branch), row 4 without a loss token (rejected or cut by the length cap).
GSPO_ROWS = [(1e-4, 1.0), (-1e-3, -0.5), (1e-3, 2.0), (-1e-3, 1.0), (5e-3, 2.0)]
GSPO_MASK = [[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]


def _gspo_batch():
    """float64 (logp with grad, logp_old, adv (B, 1), mask, weights): each row's token log-ratios vary around its
    mean; the correction weights are positive, 1 off the mask."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor(GSPO_MASK, dtype=torch.float64)
    old = -3 * torch.rand(5, 5, generator=g, dtype=torch.float64)
    noise = 1e-4 * torch.randn(5, 5, generator=g, dtype=torch.float64)
    noise = (noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)) * mask
    delta = torch.tensor([m for m, _ in GSPO_ROWS], dtype=torch.float64)[:, None] + noise
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([[a] for _, a in GSPO_ROWS], dtype=torch.float64)
    weights = torch.where(mask > 0, 0.5 + torch.rand(5, 5, generator=g, dtype=torch.float64), torch.ones_like(mask))
    return logp, old, adv, mask, weights


def _hand_gspo(logp, old, adv_tok, mask, weights, agg, per_token_weights):
    """Loss and d loss / d logp by the formulas: s_i = exp(mean_t (logp - old)); a token's term
    max(-A s_i, -A clip(s_i)) times its weight (or its sequence's geometric-mean weight); the gradient of an
    unclipped term is -w A s_i per token under GSPO-token, and the same under GSPO, whose per-sequence term is
    counted once per loss token but moves each token by 1/n_i of s_i's log."""
    B, T = mask.shape
    n_tok = mask.sum().item()
    loss, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        on = [t for t in range(T) if mask[i, t] > 0]
        if not on:
            continue
        s = math.exp(sum((logp[i, t] - old[i, t]).item() for t in on) / len(on))
        geo = math.exp(sum(math.log(weights[i, t].item()) for t in on) / len(on))
        for t in on:
            a, w = adv_tok[i, t].item(), (weights[i, t].item() if per_token_weights else geo)
            term = max(-a * s, -a * min(max(s, 1 - CL), 1 + CH))
            clipped = (a > 0 and s > 1 + CH) or (a < 0 and s < 1 - CL)
            scale = 1 / n_tok if agg == "token" else 1 / (len(on) * B)
            loss += w * term * scale
            grad[i, t] = 0.0 if clipped else -w * a * s * scale
    return loss, grad


def _objective(name, agg, adv, weights):
    from sparserl.algo.aggregation import Normalizer
    from sparserl.algo.loss import LossConfig, policy_objective

    logp, old, _, mask, _ = _gspo_batch()
    cfg = LossConfig(policy_loss=name, clip_low=CL, clip_high=CH, loss_agg=agg)
    loss, m = policy_objective(cfg, logp, old, adv, mask, Normalizer(tokens=mask.sum().item(), seqs=5.0), weights=weights)
    loss.backward()
    return loss.item(), logp.grad, m


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_gspo_loss_and_gradient_by_hand_with_correction_weights(agg):
    logp, old, adv, mask, weights = _gspo_batch()
    loss, grad, m = _objective("gspo", agg, adv, weights)
    want, want_grad = _hand_gspo(logp.detach(), old, adv.expand_as(mask), mask, weights, agg, per_token_weights=False)
    assert loss == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert (grad[1] == 0).all() and (grad[2] == 0).all() and (grad[4] == 0).all()
    assert (grad[0][mask[0] > 0] != 0).all() and (grad[3][mask[3] > 0] != 0).all()
    # clip shares count the loss tokens of the clipped sequences: 4 below (row 1), 5 above (row 2) of 14
    assert m["actor/clip_frac_low"] == pytest.approx(4 / 14) and m["actor/clip_frac_high"] == pytest.approx(5 / 14)
    assert m["actor/clip_frac"] == pytest.approx(9 / 14)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_gspo_token_loss_and_gradient_by_hand_with_per_token_advantages(agg):
    logp, old, _, mask, weights = _gspo_batch()
    g = torch.Generator().manual_seed(11)
    adv = torch.randn(5, 5, generator=g, dtype=torch.float64) * mask  # both signs inside a sequence
    loss, grad, _ = _objective("gspo_token", agg, adv, weights)
    want, want_grad = _hand_gspo(logp.detach(), old, adv, mask, weights, agg, per_token_weights=True)
    assert loss == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_gspo_and_gspo_token_agree_on_sequence_advantages_and_differ_only_by_the_weights(agg):
    _, _, adv, _, weights = _gspo_batch()
    seq = _objective("gspo", agg, adv, None)
    tok = _objective("gspo_token", agg, adv, None)
    assert seq[0] == pytest.approx(tok[0], rel=1e-12)
    torch.testing.assert_close(seq[1], tok[1], rtol=1e-10, atol=1e-15)
    # with the correction's token weights: GSPO takes their geometric mean per sequence, GSPO-token each token's
    assert not torch.allclose(_objective("gspo", agg, adv, weights)[1], _objective("gspo_token", agg, adv, weights)[1])


def test_gspo_vanishes_at_zero_advantage_and_refuses_dual_clip():
    from sparserl.algo.policy_loss import SEQUENCE_RATIO, VANISH_AT_ZERO_ADVANTAGE

    assert {"gspo", "gspo_token"} <= VANISH_AT_ZERO_ADVANTAGE and SEQUENCE_RATIO == {"gspo"}
    for name in ("gspo", "gspo_token"):
        logp, old, _, mask, _ = _gspo_batch()
        loss, _ = POLICY_LOSSES[name](logp, old, torch.zeros(5, 1, dtype=torch.float64), mask, CL, CH)
        (loss * mask).sum().backward()
        assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(logp.grad, torch.zeros_like(logp))
        with pytest.raises(ValueError, match="dual_clip"):
            POLICY_LOSSES[name](logp, old, torch.ones(5, 1, dtype=torch.float64), mask, CL, CH, dual_clip=3.0)
