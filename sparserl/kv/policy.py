"""`KVPolicyConfig`: what a KV-compression policy is configured with. It is the `rollout.kv` group of the run's
config (sparserl/config.py) and what the engines and `sparserl.kv` take; this module imports no torch, so the
config loads without it.

Building one checks every value (`config_checks.check_section("rollout.kv", ...)`): a bad value raises the same
`ConfigError` (a `ValueError`) as on the command line, naming the `rollout.kv.*` key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparserl.config_checks import check_section, opt
from sparserl.kv.budget_control import BudgetControlConfig

BUILTIN_POLICIES = ("rkv", "snapkv", "streaming")  # registered by sparserl/kv/{rkv,snapkv,streaming}.py
DIVIDE_METHODS = ("step_length", "newline")
SHARE_MODES = ("head", "layer", "all")
VARIANTS = ("paper", "reference")


@dataclass
class KVPolicyConfig:
    """One policy's settings; `algorithm` is `none` (dense), a built-in policy or one added with
    `sparserl.kv.register_policy`."""

    algorithm: str = opt("none", "none | rkv | snapkv | streaming", choices=("none", *BUILTIN_POLICIES))
    budget: int | str = opt(512, "cache entries a sequence keeps after a compression, window included; auto: chosen "
                                 "each step from the mismatch it causes (rollout.kv.control, kv/budget_control.py)")
    divide_method: str = opt("step_length", "step_length | newline", choices=DIVIDE_METHODS)
    divide_length: int = opt(128, "step_length: compress every this many decode steps once over budget")
    window: int = opt(8, "the latest tokens: always kept; their queries score the rest")
    mix_lambda: float = opt(0.1, "rkv: score = lambda * importance - (1 - lambda) * redundancy")
    kernel: int = opt(7, "max-pool kernel over the token axis")
    sim_threshold: float = opt(0.5, "rkv: cosine similarity above which two keys count as near-duplicates")
    sinks: int = opt(4, "streaming: attention-sink tokens kept at the start")
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
