"""The critic in the training step: `CriticStep` is the trainer's one handle on it, present or not, so the step reads
the same with a critic (`critic.enable=true`) and without one (every call then does nothing).

  3. `score(batch, timer)`: the critic's values of the batch's states into `batch.values` (a no-grad pass over the
     batch trained on: after the rescue, before the advantages, which GAE computes from them);
  5. the advantages (trainer/advantages.py) set `batch.returns`, the critic's targets;
  6. `train(batch, minibatches, timer)`: after the actor's update, the critic's on the same sequences, split into the
     same minibatches (after rank balancing) and packed micro-batches, `actor.updates_per_rollout` x
     `actor.ppo_epochs` optimizer steps; returns the critic/* metrics.
Saving and resuming: `checkpointed()` is what actor/checkpoint.py writes beside the actor's shards (model and
optimizer, under "critic"), `register(saved)` puts its LR schedule in the registry of saved state.

The sparsity correction meets the critic through the loss mask only: the sequences it rejects and the tokens it
masks are out of `batch.mask`, so they neither get advantages nor train the critic; its importance weights do not
scale the value loss (algo/value_loss.py, docs/decisions.md). Like the actor, the critic stays resident while the
engine rolls out (the engine's own weights and KV pool are what `engine.sleep()` gives back).
Left out on purpose: offloading the critic to host memory during the rollout (the actor is not offloaded either).
"""
from __future__ import annotations

from contextlib import AbstractContextManager

from sparserl.actor.actor import LossFn, TrainBatch
from sparserl.actor.critic import Critic
from sparserl.algo.correction import dist_reduce_sum
from sparserl.algo.value_loss import value_loss, value_stats
from sparserl.config import Config
from sparserl.trainer.saved_state import SavedState
from sparserl.utils.errors import UserError
from sparserl.utils.memory import reuse_heap

CHECKPOINT_KEY = "critic"  # its shards' prefix in a checkpoint (actor/checkpoint.py `extra`)
SCHEDULER_KEY = "critic_scheduler"  # its LR schedule in the trainer state


def build_critic(cfg: Config, model_path: str, mesh, device) -> Critic:
    """The critic of `critic.*`, on the actor's mesh, precision and micro-batching."""
    from sparserl.actor.hf import resolve_model_path

    c, a = cfg.critic, cfg.actor
    path = resolve_model_path(c.model_path) if c.model_path else model_path
    return Critic(path, mesh, device, dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype, lr=c.lr,
                  betas=a.betas, weight_decay=c.weight_decay, lr_schedule=c.lr_schedule, warmup_steps=c.warmup_steps,
                  total_steps=cfg.trainer.total_steps * a.updates_per_rollout * a.ppo_epochs,
                  min_lr_ratio=a.min_lr_ratio, max_grad_norm=c.max_grad_norm, max_tokens_per_device=a.max_tokens_per_device,
                  activation_checkpointing=cfg.model.activation_checkpointing, logprob_chunk_mb=a.logprob_chunk_mb,
                  share_prompts=a.share_prompts, seed=cfg.trainer.seed)


def value_loss_fn(clip: float | None, loss_agg: str) -> LossFn:
    """The critic's loss closure over a batch whose values, returns and mask are set; it slices them to the
    micro-batch (`values` from the forward are the update's, `batch.values` those GAE read)."""
    def loss_fn(values, _entropy, batch: TrainBatch, idx, norm):
        T = values.shape[1]
        return value_loss(values, batch.values[idx, :T], batch.returns[idx, :T], batch.mask[idx, :T], norm, clip,
                          loss_agg)

    return loss_fn


class CriticStep:
    def __init__(self, cfg: Config, model_path: str, mesh, device) -> None:
        self.critic = build_critic(cfg, model_path, mesh, device) if cfg.critic.enable else None
        self.loss_fn = value_loss_fn(cfg.critic.clip, cfg.algo.loss_agg)
        self.updates, self.epochs = cfg.actor.updates_per_rollout, cfg.actor.ppo_epochs

    @property
    def enabled(self) -> bool:
        return self.critic is not None

    def score(self, batch: TrainBatch, timer: AbstractContextManager) -> None:
        """`batch.values`: the critic's values of the batch's token states (nothing without a critic)."""
        if self.critic is None:
            return
        with timer:
            batch.values = self.critic.values(batch)

    def train(self, batch: TrainBatch, minibatches: list[list[int]] | None,
              timer: AbstractContextManager) -> dict[str, float]:
        """The critic's update on the batch the actor trained on; its metrics (none without a critic)."""
        if self.critic is None:
            return {}
        assert batch.values is not None and batch.returns is not None, "score() and the advantages come first"
        with timer, reuse_heap():
            stats = value_stats(batch.values, batch.returns, batch.mask, dist_reduce_sum(self.critic.dp_group))
            metrics = self.critic.update(batch, self.loss_fn, self.updates, self.epochs, minibatches=minibatches)
        return stats | metrics

    def checkpointed(self) -> dict:
        """The sharded (model, optimizer) pairs a checkpoint holds besides the actor's."""
        return {} if self.critic is None else {CHECKPOINT_KEY: (self.critic.model, self.critic.optimizer)}

    def register(self, saved: SavedState) -> None:
        if self.critic is not None:
            saved.add(SCHEDULER_KEY, self.critic.scheduler)

    def refuse_dropping(self, state: dict, path) -> None:
        """A checkpoint with a critic resumed with `critic.enable=false` would drop the trained critic silently (the
        actor's advantages change estimator): a UserError instead."""
        if self.critic is None and SCHEDULER_KEY in state:
            raise UserError(f"trainer.resume={path}: the checkpoint holds a trained critic, which critic.enable=false "
                            "would drop; resume with critic.enable=true (and its algo.adv_estimator), or start a new run")
