"""`env.openreward.envs`: the OpenReward environments of a run, checked and typed.

The config holds a plain map `Org/Name -> {field: value}` (a YAML mapping, or on the command line
`'env.openreward.envs={Org/Name: {weight: 2}}'`; dotted keys cannot hold the `/`). `parse_envs` turns it into
`EnvSpec`s and names the offending key, with the closest valid field names, for any mistake. Imports
nothing heavy: the preflight runs it before torch or the OpenReward SDK are loaded.

Left out on purpose: per-env sampling settings (temperature, max_new_tokens are the run's) and per-split
weights (a split of its own is an env entry of its own with `variant` and `splits`).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from sparserl.utils.errors import UserError

REWARD_REDUCTIONS = ("sum", "mean", "max", "min")
KEY = "env.openreward.envs"


@dataclass(frozen=True)
class EnvSpec:
    name: str  # Org/Name: the deployment on OpenReward, or the served class `Name`
    splits: tuple[str, ...] = ("train",)  # task splits whose tasks become prompt rows, in this order
    num_samples: int = 0  # tasks used (the first ones, over the splits in order); 0 = all
    nonterminal_reward: float = 0.0  # the reward of an env step that returned none
    reward_reduction: str = "sum"  # sum | mean | max | min over an episode's step rewards
    min_reward: float | None = None  # the episode reward is clamped to [min_reward, max_reward]; null = no bound
    max_reward: float | None = None
    max_turns: int = 8  # model turns per episode
    weight: float = 1.0  # share of each batch's prompts drawn from this env, relative to the others
    variant: str | None = None  # the env inside the deployment; null: the served class `Name`, or the deployment's default
    base_url: str | None = None  # this env's server; null: env.openreward.base_url (or the served file's server)

    @property
    def short(self) -> str:
        """A metric-safe name."""
        return self.name.replace("/", "_")


FIELDS = tuple(f.name for f in dataclasses.fields(EnvSpec) if f.name != "name")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_RULES = {
    "splits": (lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(s, str) and s for s in v),
               "a non-empty list of split names"),
    "num_samples": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0 (0 = all tasks)"),
    "nonterminal_reward": (_number, "a finite number"),
    "reward_reduction": (lambda v: v in REWARD_REDUCTIONS, f"one of {', '.join(REWARD_REDUCTIONS)}"),
    "min_reward": (lambda v: v is None or _number(v), "a finite number, or null (no bound)"),
    "max_reward": (lambda v: v is None or _number(v), "a finite number, or null (no bound)"),
    "max_turns": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "weight": (lambda v: _number(v) and v > 0, "a number > 0"),
    "variant": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "a non-empty string, or null"),
    "base_url": (lambda v: v is None or (isinstance(v, str) and v.startswith(("http://", "https://"))),
                 "an http(s) URL, or null"),
}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or name.count("/") != 1 or not all(p.strip() for p in name.split("/")):
        raise UserError(f"{KEY}: {name!r} is not an environment name of the form Org/Name")
    return name


def parse_env(name: str, entry: Any) -> EnvSpec:
    name = _check_name(name)
    if entry is None:
        entry = {}
    if not isinstance(entry, dict):
        raise UserError(f"{KEY}.{name}: must be a mapping of settings ({', '.join(FIELDS)}), got {entry!r:.80}")
    for key in entry:
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), FIELDS, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"unknown key {KEY}.{name}.{key}{hint} (valid: {', '.join(FIELDS)})")
    for key, value in entry.items():
        test, desc = _RULES[key]
        if isinstance(value, float) and key in ("num_samples", "max_turns") and value.is_integer():
            value = int(value)
        if not test(value):
            raise UserError(f"{KEY}.{name}.{key}={value!r}: must be {desc}")
    values = dict(entry)
    if "splits" in values:
        values["splits"] = tuple(values["splits"])
    for key in ("nonterminal_reward", "weight", "min_reward", "max_reward"):
        if values.get(key) is not None:
            values[key] = float(values[key])
    spec = EnvSpec(name=name, **values)
    if spec.min_reward is not None and spec.max_reward is not None and spec.min_reward > spec.max_reward:
        raise UserError(f"{KEY}.{name}.min_reward={spec.min_reward:g} must be <= max_reward={spec.max_reward:g}")
    return spec


def parse_envs(envs: Any) -> list[EnvSpec]:
    """The specs of `env.openreward.envs`, in the config's order (empty when none are configured)."""
    if envs is None:
        return []
    if not isinstance(envs, dict):
        raise UserError(f"{KEY}: must be a mapping Org/Name -> settings, got {envs!r:.80}")
    return [parse_env(name, entry) for name, entry in envs.items()]
