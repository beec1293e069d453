"""`KVPolicyConfig`: what a KV-compression policy is configured with. It is the `rollout.kv` group of the run's
config (sparserl/config/schema.py) and what the engines and `sparserl.kv` take; this module imports no torch, so the
config loads without it.

Building one checks every value (`sparserl.config.fields.check_section("rollout.kv", ...)`: the rules declared with
the fields, then `RELATIONS`): a bad value raises the same `ConfigError` (a `ValueError`) as on the command line,
naming the `rollout.kv.*` key.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from sparserl.config.fields import COUNT, NON_NEG, ODD, PROB, ConfigError, Rule, check_section, opt, within
from sparserl.kv.budget_control import BudgetControlConfig

BUILTIN_POLICIES = ("rkv", "snapkv", "streaming")  # registered by sparserl/kv/{rkv,snapkv,streaming}.py
DIVIDE_METHODS = ("step_length", "newline")
SHARE_MODES = ("head", "layer", "all")
VARIANTS = ("paper", "reference")
BUDGET = Rule(lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
              "an integer >= 1 or auto")


def registered_policies() -> tuple[str, ...]:
    """KV policies in sparserl.kv's registry (built-in and `register_policy`'s), which `algorithm` accepts as well;
    where the registry is not loaded, no policy can have been registered (this module imports no torch)."""
    base = sys.modules.get("sparserl.kv.base")
    return tuple(getattr(base, "POLICIES", ())) if base is not None else ()


def _kv_fits(kv: Any, p: str) -> None:
    # Under budget=auto the smallest budget the controller may choose must fit what a fixed budget must.
    key, budget = (f"{p}.control.floor", kv.control.floor) if kv.budget == "auto" else (f"{p}.budget", kv.budget)
    if budget <= kv.window:
        raise ConfigError(f"{key}={budget} must be > {p}.window={kv.window} (the window alone would fill the budget)")
    if kv.algorithm == "streaming" and kv.sinks > budget - kv.window:
        raise ConfigError(f"{p}.sinks={kv.sinks} must be <= {key} - {p}.window ({budget - kv.window}) so that every "
                          "sink fits")


@dataclass
class KVPolicyConfig:
    """One policy's settings; `algorithm` is `none` (dense), a built-in policy or one added with
    `sparserl.kv.register_policy`."""

    RELATIONS: ClassVar[tuple] = (_kv_fits,)

    algorithm: str = opt("none", "none | rkv | snapkv | streaming", choices=("none", *BUILTIN_POLICIES),
                         more=registered_policies)
    budget: int | str = opt(512, "cache entries a sequence keeps after a compression, window included; auto: chosen "
                                 "each step from the mismatch it causes (rollout.kv.control, kv/budget_control.py)",
                            rule=BUDGET)
    divide_method: str = opt("step_length", "step_length | newline", choices=DIVIDE_METHODS)
    divide_length: int = opt(128, "step_length: compress every this many decode steps once over budget", rule=COUNT)
    window: int = opt(8, "the latest tokens: always kept; their queries score the rest", rule=COUNT)
    mix_lambda: float = opt(0.1, "rkv: score = lambda * importance - (1 - lambda) * redundancy", rule=PROB)
    kernel: int = opt(7, "max-pool kernel over the token axis", rule=ODD)
    sim_threshold: float = opt(0.5, "rkv: cosine similarity above which two keys count as near-duplicates",
                               rule=within("[-1, 1]"))
    sinks: int = opt(4, "streaming: attention-sink tokens kept at the start", rule=NON_NEG)
    share: str = opt("head", "head | layer | all", choices=SHARE_MODES)
    compress_prompt: bool = opt(False, "may the prompt be compressed below its own length")
    variant: str = opt("paper", "paper | reference: rkv/snapkv score as their papers say, or exactly as the R-KV / "
                                "Sparse-RL code", choices=VARIANTS)
    control: BudgetControlConfig = opt(BudgetControlConfig, "rollout.kv.budget=auto: how the budget follows the "
                                                             "mismatch tail (sparserl/kv/budget_control.py).")

    def __post_init__(self) -> None:
        if isinstance(self.control, dict):  # rebuilt from dataclasses.asdict (the SGLang scheduler's copy)
            self.control = BudgetControlConfig(**self.control)
        check_section("rollout.kv", self)

    @property
    def auto_budget(self) -> bool:
        return self.budget == "auto"

    def with_budget(self, budget: int | None = None) -> KVPolicyConfig:
        """This config with a number for `budget`: `budget` when given, else the configured one, or under
        `budget=auto` the controller's first step's (`control.ceiling`). Engines take only numbers."""
        value = budget if budget is not None else (self.control.ceiling if self.auto_budget else self.budget)
        return self if value == self.budget else dataclasses.replace(self, budget=int(value))

    @property
    def normalize_sums(self) -> bool:
        """Shared sets sum min-max-normalized rows (paper), or raw scores as the reference code does (reference)."""
        return self.variant == "paper"
