"""An episode's reward from its env steps: fill, reduce, clamp (`env.openreward.envs.*`).

Each env answer that can carry a reward (a tool result, the terminal tool's result) is one step; a step
whose reward is None counts as `nonterminal_reward`. The steps reduce by `reward_reduction` (a registry of
small functions), an episode with no steps scores 0, and the result is clamped to [min_reward, max_reward].
Malformed or refused tool calls are not steps: the env never answered them.
"""
from __future__ import annotations

from typing import Callable, Sequence

from sparserl.rollout.openreward.spec import EnvSpec

REDUCTIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "sum": lambda xs: float(sum(xs)),
    "mean": lambda xs: float(sum(xs)) / len(xs),
    "max": lambda xs: float(max(xs)),
    "min": lambda xs: float(min(xs)),
}


def episode_reward(step_rewards: Sequence[float | None], spec: EnvSpec) -> float:
    filled = [spec.nonterminal_reward if r is None else float(r) for r in step_rewards]
    reward = REDUCTIONS[spec.reward_reduction](filled) if filled else 0.0
    if spec.min_reward is not None:
        reward = max(reward, spec.min_reward)
    if spec.max_reward is not None:
        reward = min(reward, spec.max_reward)
    return reward
