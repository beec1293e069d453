import pytest
import torch

from sparserl.algo.aggregation import Normalizer, aggregate, count_normalizer
from sparserl.algo.loss import LossConfig, policy_objective


def test_hand_example():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    norm = Normalizer(tokens=3.0, seqs=2.0)
    assert aggregate("token", x, mask, norm).item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate("sequence", x, mask, norm).item() == pytest.approx((1.5 + 4.0) / 2)
    # global counts, not this call's: a micro-batch of a larger minibatch
    assert aggregate("token", x, mask, Normalizer(6.0, 4.0)).item() == pytest.approx(7 / 6)
    assert aggregate("sequence", x, mask, Normalizer(6.0, 4.0)).item() == pytest.approx(5.5 / 4)


def test_empty_mask_is_zero_not_nan():
    x = torch.ones(2, 3)
    mask = torch.zeros(2, 3)
    for name in ("token", "sequence"):
        assert aggregate(name, x, mask, Normalizer(0.0, 0.0)).item() == 0.0


def test_count_normalizer():
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]])]
    assert count_normalizer(masks) == Normalizer(tokens=3.0, seqs=3.0)
    assert count_normalizer(masks, reduce_sum=lambda t: 2 * t) == Normalizer(tokens=6.0, seqs=6.0)
    assert count_normalizer([]) == Normalizer(0.0, 0.0)


def _batch(B=8, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = logp_old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp_ref = logp_old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    weights = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    entropy_base = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp, logp_old, logp_ref, adv, mask, weights, entropy_base


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_micro_batch_split_gives_same_loss_and_gradient(agg):
    logp0, logp_old, logp_ref, adv, mask, weights, ent0 = _batch()
    cfg = LossConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, clip_high=0.28)

    def run(n_micro):
        logp = logp0.clone().requires_grad_(True)
        chunks = [torch.arange(len(logp0)).chunk(n_micro)][0]
        norm = count_normalizer([mask[i] for i in chunks])
        total = 0.0
        for i in chunks:
            entropy = ent0[i] * logp[i].exp()  # depends on logp so it carries gradient
            loss, _ = policy_objective(cfg, logp[i], logp_old[i], adv[i], mask[i], norm,
                                       weights=weights[i], logp_ref=logp_ref[i], entropy=entropy)
            loss.backward()
            total += loss.item()
        return total, logp.grad

    loss1, grad1 = run(1)
    loss4, grad4 = run(4)
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    torch.testing.assert_close(grad4, grad1, rtol=1e-6, atol=1e-12)
    assert grad1.abs().sum() > 0


def test_unknown_aggregation():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate("mean", torch.ones(1, 1), torch.ones(1, 1), Normalizer(1.0, 1.0))
