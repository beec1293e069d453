import math

import pytest
import torch

from sparserl.algo.kl import KL_ESTIMATORS, kl_estimate


def _at(d):
    # logp - logp_ref = d
    logp = torch.tensor([d], dtype=torch.float64)
    return logp, torch.zeros_like(logp)


@pytest.mark.parametrize("d,k1,k2,k3", [
    (0.5, 0.5, 0.125, math.exp(-0.5) + 0.5 - 1),   # 0.1065307
    (-1.0, -1.0, 0.5, math.e - 2),                  # 0.7182818
    (0.0, 0.0, 0.0, 0.0),
])
def test_values(d, k1, k2, k3):
    logp, ref = _at(d)
    assert kl_estimate("k1", logp, ref).item() == pytest.approx(k1)
    assert kl_estimate("k2", logp, ref).item() == pytest.approx(k2)
    assert kl_estimate("k3", logp, ref).item() == pytest.approx(k3)


def test_aliases():
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]
    assert KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    assert KL_ESTIMATORS["kl"] is KL_ESTIMATORS["k1"]


def test_k3_nonnegative_and_clamped():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 32, generator=g) * 3
    ref = torch.randn(64, 32, generator=g) * 3
    assert (kl_estimate("k3", logp, ref) >= 0).all()
    big, ref = _at(100.0)
    assert kl_estimate("k3", big, ref).item() == pytest.approx(math.exp(-20) + 19)
    small, ref = _at(-100.0)
    assert kl_estimate("k3", small, ref).item() == pytest.approx(math.exp(20) - 21)


def test_k3_gradient():
    logp = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    kl_estimate("k3", logp, ref).sum().backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5))
    assert ref.grad is None  # the reference is a constant


def test_unknown():
    with pytest.raises(ValueError, match="valid"):
        kl_estimate("k4", *_at(0.0))
