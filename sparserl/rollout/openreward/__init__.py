"""OpenReward environments (tool use, multi-turn) for the rollout worker; see driver.py for the episode loop.

Imports nothing from the OpenReward SDK until an env is reached: `spec.py` (config checks) runs in the
preflight before anything heavy is loaded.
"""
from sparserl.rollout.openreward.spec import EnvSpec, parse_envs

__all__ = ["EnvSpec", "parse_envs"]
