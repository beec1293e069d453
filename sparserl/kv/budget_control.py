"""`rollout.kv.budget=auto`: the KV budget chosen step by step by the mismatch it causes. Plain Python.

The statistic is the tail of the per-token ratio xi = p_dense / p_sparse of the sampled tokens (`logp_old` against
`logp_sparse`, the trainer has both every step): its 5th percentile over every sampled token the step scored
densely (with partial rollouts, every one drawn in the step: a carried token's xi also holds the updates since it
was drawn, which no budget would repair), all DP ranks together, before dynamic sampling, the correction or the rescue chose what to train on
(`sampler/xi_p05`, algo/sampler_stats.py). Those filters drop or replace exactly the low-xi sequences, so the trained
batch's tail (`mismatch/xi_p05`) reads higher than the sampler's and would let the budget fall past `target`. A
compressed sampler that drew tokens the dense policy finds much less likely pulls that tail down; the mean barely
moves (most tokens agree exactly). The value read each step is logged as `kv/budget_tail`.

The rule, applied after each step to choose the next step's budget (`BudgetController.update`):
  * tail below `target`: the budget rises at once by `factor` (capped at `ceiling`);
  * tail at or above `target + hysteresis` for `patience` steps in a row: it falls by `factor` (not below `floor`);
  * in between (the hysteresis band), or a step without response tokens: it holds.
Budgets are rounded to multiples of `align` entries. The first step runs at `ceiling` (the safe end) and the
controller walks down while the tail allows it, so a run starts where a fixed-budget run known to be stable would.

`statistic` picks the quantile: `xi_p05` (default, the anchor's) or `xi_p01`. Where the mismatch sits on a few
tokens of each response (a fact read from a compressed prompt), fewer than 5% of the tokens carry it and the 5th
percentile stays near 1 at budgets that make the correction reject a third of the sequences; the 1st percentile
sees them (docs/replications.md, "Keeping the dense gain").

The anchor (Sparrow, arXiv 2606.08446) found training stable while the 5th-percentile ratio stayed above ~0.86
and keeps that statistic constant *within* a rollout, with a sparsity schedule over the generation found offline
by a cost model. This controller acts *between* steps on the measured statistic instead: no offline sweep, one
budget per step for every sequence, and it follows the policy as training moves it. The asymmetric steps (up at
once, down only after `patience` calm steps, with a band between) keep it from oscillating around the target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sparserl.config.fields import COUNT, NON_NEG, above, check_section, opt, ordered, within


def tail_key(statistic: str) -> str:
    """The metric the controller reads for `rollout.kv.control.statistic`: the sampler's own tail."""
    return f"sampler/{statistic}"


def tail_of(metrics: dict, statistic: str) -> float | None:
    """The step's tail statistic (`rollout.kv.control.statistic`) as the controller must see it: the sparse
    sampler's own, over every sampled token the step scored densely, before any filter (`tail_key`)."""
    return metrics.get(tail_key(statistic))


@dataclass
class BudgetControlConfig:
    """`rollout.kv.control.*`: read only when `rollout.kv.budget=auto`."""

    RELATIONS: ClassVar[tuple] = (lambda control, p: ordered(control, p, "floor", "ceiling"),)

    floor: int = opt(64, "the smallest budget the controller may choose (> rollout.kv.window)", rule=COUNT)
    ceiling: int = opt(1024, "the largest budget, and the first step's", rule=COUNT)
    target: float = opt(0.86, "keep the 5th percentile of xi = p_dense / p_sparse over a step's response tokens at "
                              "or above this", rule=within("(0, 1]"))
    hysteresis: float = opt(0.03, "lower the budget only while the tail is at or above target + hysteresis",
                            rule=NON_NEG)
    factor: float = opt(1.25, "the budget moves by this factor: up at once when the tail is below target, down "
                              "after `patience` calm steps", rule=above(1))
    patience: int = opt(2, "steps in a row at or above target + hysteresis before the budget is lowered", rule=COUNT)
    align: int = opt(8, "budgets are multiples of this many entries", rule=COUNT)
    statistic: str = opt("xi_p05", "the tail statistic held above `target`: the 5th percentile of xi (the anchor's) "
                                   "or the 1st (for tasks where fewer than 5% of the tokens carry the mismatch)",
                         choices=("xi_p05", "xi_p01"))

    def __post_init__(self) -> None:
        check_section("rollout.kv.control", self)


class BudgetController:
    """The budget of the next step from each step's tail statistic; its state goes into checkpoints."""

    def __init__(self, cfg: BudgetControlConfig) -> None:
        self.cfg = cfg
        self.budget = cfg.ceiling
        self.calm = 0  # steps in a row at or above target + hysteresis

    def _round(self, value: float, up: bool) -> int:
        a = self.cfg.align
        steps = math.ceil(value / a) if up else math.floor(value / a)
        return max(self.cfg.floor, min(self.cfg.ceiling, steps * a))

    def update(self, tail: float | None) -> int:
        """Record one step's tail statistic (None or NaN: the step had no response tokens) and return the budget
        for the next step."""
        c = self.cfg
        if tail is None or not math.isfinite(tail):
            return self.budget
        if tail < c.target:
            self.calm = 0
            raised = self._round(self.budget * c.factor, up=True)
            self.budget = max(raised, min(c.ceiling, self.budget + c.align))  # always a real step up below ceiling
        elif tail >= c.target + c.hysteresis:
            self.calm += 1
            if self.calm >= c.patience:
                self.calm = 0
                lowered = self._round(self.budget / c.factor, up=False)
                self.budget = min(lowered, max(c.floor, self.budget - c.align))
        else:
            self.calm = 0
        return self.budget

    def state_dict(self) -> dict:
        return {"budget": self.budget, "calm": self.calm}

    def load_state_dict(self, state: dict) -> None:
        self.budget = max(self.cfg.floor, min(self.cfg.ceiling, int(state["budget"])))
        self.calm = int(state.get("calm", 0))
