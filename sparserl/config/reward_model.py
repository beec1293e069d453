"""`env.reward_model.*`: a learned reward for the RL trainer (sparserl/trainer/learned_reward.py, docs/rm.md).
Plain Python: no torch."""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.config.fields import above, opt


@dataclass
class RewardModelConfig:
    """A learned reward: a reward-model export of `sparserl.trainer.rm` scores every sample of the RL trainer."""

    path: str = opt("", "an rm export (outputs/rm/hf: ForSequenceClassification, num_labels=1) sharing the policy's "
                        "tokenizer; empty: the env's reward only")
    mode: str = opt("replace", "replace: the reward is the model's score; add: the env's reward plus "
                               "env.reward_model.coef x the score", choices=("replace", "add"))
    coef: float = opt(1.0, "the score's weight in the reward (both modes)", rule=above(0))
