"""`CriticConfig`: the `critic.*` group of the run's config (sparserl/config/schema.py), the value model that
`algo.adv_estimator=gae` reads (sparserl/actor/critic.py builds it, sparserl/trainer/critic.py runs it in the step).
Plain Python: no torch.

The critic is sharded as the actor is (FSDP2 over dp, tensor parallel over tp, context parallel over cp), packs the
actor's micro-batches (actor.max_tokens_per_device, actor.share_prompts), and runs the actor's precision
(model.dtype, model.compute_dtype, model.activation_checkpointing); its optimizer is AdamW with the actor's betas.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.config.fields import NON_NEG, above, opt, or_null


@dataclass
class CriticConfig:
    """A value model trained beside the actor: a scalar head on the last hidden state of the actor's architecture."""

    enable: bool = opt(False, "train a critic after the actor in every step; algo.adv_estimator=gae reads its values "
                              "(+preset=ppo turns both on)")
    model_path: str = opt("", "the critic's initial weights (an HF folder or hub id, the same kinds as model.path); "
                              "empty: model.path. The LM head is replaced by a new scalar value head")
    lr: float = opt(1e-5, "AdamW learning rate of the critic after warmup", rule=NON_NEG)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay of the critic", rule=NON_NEG)
    lr_schedule: str = opt("constant", "constant | cosine (to actor.min_lr_ratio)", choices=("constant", "cosine"))
    warmup_steps: int = opt(0, "optimizer steps of linear warmup of the critic", rule=NON_NEG)
    max_grad_norm: float = opt(1.0, "the critic's gradients clipped to this global norm", rule=above(0))
    clip: float | None = opt(0.5, "value clipping: the update's value may move at most this far from the value GAE "
                                  "read before its error counts (PPO's); null = plain squared error",
                             rule=or_null(above(0)))
