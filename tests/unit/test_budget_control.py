"""rollout.kv.budget=auto: the controller's rule on synthetic tail streams, its bounds, hysteresis and resume, and the
histogram quantile it reads (`mismatch/xi_p05`)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from sparserl.algo.correction import _log_xi_histogram, histogram_quantile, low_xi_metrics
from sparserl.kv.budget_control import BudgetControlConfig, BudgetController


def plant(budget: int, rng: random.Random, noise: float = 0.01) -> float:
    """A synthetic mismatch tail that improves with the budget: 0.84 at 256 entries, 0.875 at 320, 0.92 at 512."""
    return 1.0 - 40.0 / budget + rng.gauss(0.0, noise)


def run(ctrl: BudgetController, steps: int, rng: random.Random) -> list[tuple[int, float]]:
    out = []
    for _ in range(steps):
        b = ctrl.budget
        tail = plant(b, rng)
        out.append((b, tail))
        ctrl.update(tail)
    return out


def test_the_tail_stays_above_target_at_the_smallest_budget_that_allows_it():
    cfg = BudgetControlConfig(floor=64, ceiling=2048, target=0.86, hysteresis=0.03, factor=1.25, patience=2)
    trace = run(BudgetController(cfg), 80, random.Random(0))
    settled = trace[30:]
    above = sum(t >= cfg.target for _, t in settled) / len(settled)
    assert above >= 0.9, above  # below target only on the steps that trigger a raise
    # The smallest budget the plant allows is 40 / 0.14 = 286; the controller settles within two factors of it, far
    # below the ceiling it started at, and never where the noise-free tail is 0.02 under target (250).
    budgets = [b for b, _ in settled]
    assert trace[0][0] == 2048
    assert 256 <= min(budgets) and max(budgets) <= 286 * 1.25 ** 2, (min(budgets), max(budgets))


def test_bounds_hold_whatever_the_tail_says():
    cfg = BudgetControlConfig(floor=96, ceiling=512, factor=2.0, patience=1)
    ctrl = BudgetController(cfg)
    for _ in range(20):
        ctrl.update(1.0)  # no mismatch at all: walk down to the floor
    assert ctrl.budget == 96
    for _ in range(20):
        ctrl.update(0.1)  # a heavy tail: up to the ceiling
    assert ctrl.budget == 512
    assert ctrl.update(0.1) == 512


def test_budgets_step_by_factor_on_the_alignment():
    ctrl = BudgetController(BudgetControlConfig(floor=64, ceiling=1024, factor=1.25, patience=1, align=8))
    assert ctrl.update(0.99) == 816  # 1024 / 1.25 = 819.2, down to a multiple of 8
    assert ctrl.update(0.99) == 648  # 652.8 -> 648
    assert ctrl.update(0.5) == 816  # 648 * 1.25 = 810 -> up to 816


def test_hysteresis_band_holds_and_patience_counts_calm_steps_in_a_row():
    cfg = BudgetControlConfig(floor=64, ceiling=1024, target=0.86, hysteresis=0.04, factor=2.0, patience=3)
    ctrl = BudgetController(cfg)
    for _ in range(10):
        assert ctrl.update(0.88) == 1024  # inside [target, target + hysteresis): hold
    assert ctrl.update(0.95) == 1024 and ctrl.update(0.95) == 1024
    assert ctrl.update(0.89) == 1024  # a step inside the band resets the count
    assert ctrl.update(0.95) == 1024 and ctrl.update(0.95) == 1024
    assert ctrl.update(0.95) == 512  # the third calm step in a row lowers it
    assert ctrl.update(0.85) == 1024  # below target: up at once


def test_a_step_without_tokens_holds_the_budget():
    ctrl = BudgetController(BudgetControlConfig(patience=1))
    assert ctrl.update(None) == ctrl.update(math.nan) == 1024


def test_resume_continues_exactly():
    cfg = BudgetControlConfig(floor=64, ceiling=2048, patience=2)
    rng = random.Random(1)
    tails = [plant(256 + 64 * (i % 5), rng) for i in range(40)]
    whole = BudgetController(cfg)
    expect = [whole.update(t) for t in tails]
    first = BudgetController(cfg)
    got = [first.update(t) for t in tails[:17]]
    state = first.state_dict()
    resumed = BudgetController(cfg)
    resumed.load_state_dict(dict(state))
    got += [resumed.update(t) for t in tails[17:]]
    assert got == expect


def test_histogram_quantile_matches_numpy_and_sums_over_ranks():
    torch.manual_seed(0)
    log_xi = torch.randn(20000, dtype=torch.float64) * 0.2 - 0.05
    for q in (0.01, 0.05, 0.5):
        want = float(np.quantile(np.exp(log_xi.numpy()), q))
        assert histogram_quantile(_log_xi_histogram(log_xi), q) == pytest.approx(want, rel=3e-3)
    halves = _log_xi_histogram(log_xi[:7000]) + _log_xi_histogram(log_xi[7000:])  # what the all-reduce sums
    assert torch.equal(halves, _log_xi_histogram(log_xi))
    assert math.isnan(histogram_quantile(torch.zeros_like(halves), 0.05))
    assert histogram_quantile(_log_xi_histogram(torch.full((10,), -19.0)), 0.05) == pytest.approx(math.exp(-5))


def test_the_logged_tail_covers_response_tokens_only():
    logp_sparse = torch.zeros(2, 4)
    logp_old = torch.tensor([[math.log(0.5), 0.0, 0.0, -30.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])  # the -30 is padding
    m = low_xi_metrics(logp_old, logp_sparse, mask, torch.ones(2))
    # 7 tokens: one at xi = 0.5, six at 1. The 5th percentile (rank 0.35) lies in 0.5's bin.
    assert m["mismatch/xi_p05"] == pytest.approx(0.5, rel=3e-3)
    assert m["mismatch/low_xi_frac"] == 0.0


def test_the_chosen_statistic_of_the_sampler_s_own_tail_steers():
    from sparserl.kv.budget_control import tail_of

    # A step whose mismatch sits on fewer than 5% of the tokens: the 5th percentile is calm, the 1st is not.
    step = {"mismatch/xi_p05": 0.997, "mismatch/xi_p01": 0.05, "sampler/xi_p05": 0.95, "sampler/xi_p01": 0.02}
    assert tail_of(step, "xi_p05") == 0.95 and tail_of(step, "xi_p01") == 0.02  # the sampler's, not the trained batch's
    assert tail_of({"mismatch/xi_p05": 0.997}, "xi_p05") is None

    budgets = {}
    for statistic in ("xi_p05", "xi_p01"):
        cfg = BudgetControlConfig(floor=128, ceiling=192, patience=1, statistic=statistic)
        ctrl = BudgetController(cfg)
        ctrl.budget = 152
        budgets[statistic] = ctrl.update(tail_of(step, statistic))
    assert budgets == {"xi_p05": 128, "xi_p01": 192}  # lowered on the calm quantile, raised on the one that sees it


def test_an_unknown_statistic_is_refused():
    from sparserl.config.fields import ConfigError

    with pytest.raises(ConfigError, match="rollout.kv.control.statistic=xi_p10: must be one of xi_p05, xi_p01"):
        BudgetControlConfig(statistic="xi_p10")
