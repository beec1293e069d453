"""`CorrectionConfig`: the settings of the sparse-rollout correction (sparserl/algo/correction.py). It is the
`algo.correction` group of the run's config (sparserl/config/schema.py) and what `correct` takes; this module imports no
torch, so the config loads without it.

Building one checks every value (`sparserl.config.fields.check_section("algo.correction", ...)`): a bad value raises
the same `ConfigError` (a `ValueError`) as on the command line, naming the `algo.correction.*` key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sparserl.config.fields import NON_NEG, PROB, check_section, opt, or_null, ordered


def _bounds(corr: Any, p: str) -> None:
    ordered(corr, p, "token_low", "token_high")
    ordered(corr, p, "geo_low", "geo_high")


@dataclass
class CorrectionConfig:
    """`algo.correction.*`. A bound set to None (or a cap set to None/0) switches that piece off; `mode=measure`
    computes every metric and changes nothing. Built directly, the correction is on (`enable=True`); the run's
    config starts with it off (+preset=sparse_rl turns it on)."""

    RELATIONS: ClassVar[tuple] = (_bounds,)

    enable: bool = opt(True, "correct the sparse/dense mismatch in the loss (docs/correction.md)")
    mode: str = opt("apply", "apply | measure", choices=("apply", "measure"))
    is_cap: float | None = opt(1.5, "importance weight min(xi, is_cap); null or 0 = no reweighting",
                               rule=or_null(NON_NEG))
    is_batch_normalize: bool = opt(True, "divide the weights by their batch mean")
    normalize_over: str = opt("kept", "kept | all (the reference recipe: mean over every response token, before "
                                      "rejection)", choices=("kept", "all"))
    apply_to_kl: bool = opt(False, "weight the KL term too")
    veto: float | None = opt(1e-4, "reject a sequence with any token's xi below this", rule=or_null(NON_NEG))
    token_low: float | None = opt(0.5, "mask tokens with xi below this", rule=or_null(NON_NEG))
    token_high: float | None = opt(1.5, "mask tokens with xi above this", rule=or_null(NON_NEG))
    geo_low: float | None = opt(None, "reject a sequence whose geometric-mean xi is below this", rule=or_null(NON_NEG))
    geo_high: float | None = opt(None, "reject a sequence whose geometric-mean xi is above this", rule=or_null(NON_NEG))
    rejected_in_baseline: bool = opt(True, "rejected sequences still count in their group's reward baseline")
    rescue: str = opt("none", "none | dense: roll the sequences the correction rejects out again with a dense KV cache "
                              "(same prompts, one new sample each) and train on those instead (docs/correction.md)",
                      choices=("none", "dense"))
    rescue_group_frac: float = opt(0.0, "with rescue=dense: a group with at least this share of its samples rejected is "
                                        "re-rolled whole, so its baseline compares samples of one sampler; 0 = only "
                                        "the rejected samples", rule=PROB)

    def __post_init__(self) -> None:
        check_section("algo.correction", self)
