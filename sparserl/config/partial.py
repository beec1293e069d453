"""`rollout.partial.*`, partial rollouts (sparserl/rollout/partial.py, docs/training.md), and the checks that relate
it to the rest of the run (`cross_check`, one of relations.py's CROSS_CHECKS). Plain Python: no torch.

Left out on purpose: partial rollouts with OpenReward episodes (refused here, with the way out); docs/decisions.md
says why. Both engines stop and resume samples; multi-turn env modules are carried (rollout/partial.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.config.fields import NON_NEG, ConfigError, opt, within


@dataclass
class PartialConfig:
    enable: bool = opt(False, "carry a step's unfinished samples into the next step, where they resume under the new "
                              "weights beside the step's new prompts; a group trains once all its samples ended")
    finish_frac: float = opt(0.5, "a step's generation stops once this share of its samples (carried ones included) "
                                  "have ended; 1 = wait for every sample", rule=within("(0, 1]"))
    max_tokens: int = opt(0, "the most tokens one sample draws in one step before it is carried; 0 = no bound",
                          rule=NON_NEG)
    max_staleness: int = opt(2, "the most steps a sample may be carried: one whose group started this many steps ago "
                                "runs to its end in the step (0 = never carried, as without partial rollouts)",
                             rule=NON_NEG)


def cross_check(cfg) -> None:
    """What partial rollouts do not combine with (env modules only; no dynamic sampling, no rescue)."""
    p = cfg.rollout.partial
    if not p.enable:
        return
    why = ("env.openreward.envs: OpenReward episodes are not carried across steps" if cfg.env.openreward.envs else
           "algo.dynamic_sampling.enable=true: its rounds refill a step that partial rollouts leave open; turn one off"
           if cfg.algo.dynamic_sampling.enable else
           f"algo.correction.rescue={cfg.algo.correction.rescue}: the rescue redraws a sample from its step's prompts, "
           "which a carried sample's step no longer has; set algo.correction.rescue=none"
           if cfg.algo.correction.rescue != "none" else "")
    if why:
        raise ConfigError(f"rollout.partial.enable=true with {why}")
