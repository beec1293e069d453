"""The critic: a value model sharded and trained by the actor's code, with a scalar head on the last hidden state.

`Critic` is an `Actor` whose model carries one more module, `value_head` (Linear(hidden, 1) with a bias, the weight
drawn N(0, initializer_range) from the seed, the bias 0; the same on every rank), added before parallelism
(`Actor(extend=...)`). So loading (rank 0 reads and broadcasts), FSDP2 over dp (x cp), context parallelism, packed
micro-batches with shared prompts, activation checkpointing, gradient accumulation, clipping, the non-finite guard
and the optimizer step are the actor's, unchanged. Its forward (`packed_values`) runs the actor's packed layout and
replaces the LM head's computation (the forward context's head, as the log-prob head does) by the value head on the
rows the actor keeps: row t is the state in which response token t is sampled (the prompt and the tokens before
it), so a critic value lines up with the token's log-prob, (b, T) response-aligned.

The LM head stays in the module (Hugging Face's forward calls it) but computes nothing: untied, it is frozen (no
optimizer state; in the checkpoint with the critic's other tensors); tied, it is the embedding, which trains.
With tensor parallelism the value head is replicated over tp (`TP_PLAN`): every rank computes the same values from
the replicated last hidden state, as the replicated norms do.

Left out on purpose: a critic that shares the actor's trunk (two heads, one model), reading a value head back from
`critic.model_path` (a run starts from a causal LM; the head from the seed), and LoRA for the critic.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from sparserl.actor.actor import Actor, LossFn, TrainBatch
from sparserl.actor.logprobs import PackedSeqs, _layout, unflatten
from sparserl.actor.parallelize import EXTRA_PLAN
from sparserl.actor.reward import head_rows
from sparserl.algo.value_loss import SUMMED
from sparserl.model.attention import ATTN_NAME, use_packed_attention

HEAD = "value_head"  # the head's attribute on the model, and its parameters' names in the checkpoint
TP_PLAN = {HEAD: "replicate"}  # added to the model family's tensor-parallel plan (actor/parallelize.py EXTRA_PLAN)


def add_value_head(model: torch.nn.Module, seed: int) -> None:
    """`model.value_head`: Linear(hidden, 1), weight N(0, initializer_range) from `seed`, bias 0 (every rank alike)."""
    hidden = model.config.hidden_size
    embed = model.get_input_embeddings().weight
    head = torch.nn.Linear(hidden, 1, dtype=embed.dtype, device=embed.device)
    if head.weight.device.type != "meta":
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(model.config, "initializer_range", 0.02))
        with torch.no_grad():
            head.weight.copy_(torch.randn(1, hidden, generator=gen, dtype=torch.float32) * std)
            head.bias.zero_()
    setattr(model, HEAD, head)
    setattr(model, EXTRA_PLAN, TP_PLAN)
    lm_head = model.get_output_embeddings()
    if lm_head is not None and lm_head.weight is not embed:  # untied: nothing reads it, so it does not train
        lm_head.weight.requires_grad_(False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ValueHead:
    """The forward context's head: the value of each kept row, (N,) float32 in `logp` (the field callers read)."""

    def __init__(self, targets, head: torch.nn.Linear) -> None:
        self.head = head
        self.logp: torch.Tensor | None = None
        self.entropy = None

    def __call__(self, hidden: torch.Tensor, weight, bias) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        w, b = _local(self.head.weight), _local(self.head.bias)
        self.logp = F.linear(h, w.to(h.dtype), b.to(h.dtype)).squeeze(-1).to(torch.promote_types(h.dtype, torch.float32))
        return self.logp.detach().view(*hidden.shape[:-1], 1)


def packed_values(model: torch.nn.Module, seqs: PackedSeqs, device: torch.device,
                  hold_context: contextlib.ExitStack | None = None, share_prompts: bool = True, cp=None) -> torch.Tensor:
    """(b, T) response-aligned values of one packed micro-batch (0 beyond each response), differentiable. The layout
    is the actor's (`logprobs._layout`); with `cp` each rank computes its zigzag share and the values are gathered."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        use_packed_attention(model)
    rows = head_rows(model, _layout(seqs, share_prompts), device, cp, hold_context, getattr(model, HEAD), ValueHead)
    return unflatten(rows, seqs.resp_lens)


class Critic(Actor):
    """The actor's machinery around a value model: `_forward` returns (b, T) values where the actor returns
    log-probs, so `values` (the actor's no-grad pass) and `update` (its minibatch loop) serve it unchanged; the
    loss is `algo/value_loss.py`'s (trainer/critic.py builds the closure). Metrics come back as critic/*."""

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, seed=seed, extend=lambda m: add_value_head(m, seed), skip_zero_advantage=False,
                         **kwargs)

    summed = property(lambda self: SUMMED)

    def _forward(self, batch: TrainBatch, mb: list[int], with_entropy: bool, hold_context=None):
        seqs = PackedSeqs([[0, 0]], [1]) if not mb else PackedSeqs([batch.ids[i] for i in mb],
                                                                    [batch.prompt_lens[i] for i in mb])
        return packed_values(self.model, seqs, self.device, hold_context, self.share_prompts, self.cp), None

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """(B, T) values of every response token's state under the current weights."""
        return self.logprobs(batch)

    def update(self, batch: TrainBatch, loss_fn: LossFn, num_minibatches: int = 1, epochs: int = 1,
               with_entropy: bool = False, minibatches: list[list[int]] | None = None) -> dict[str, float]:
        metrics = super().update(batch, loss_fn, num_minibatches, epochs, False, minibatches)
        return {_RENAMED.get(k, k): v for k, v in metrics.items()}


# The update loop's own metrics under the critic's names (its loss's are critic/* already).
_RENAMED = {"actor/grad_norm": "critic/grad_norm", "actor/skipped_steps": "critic/skipped_steps", "actor/lr": "critic/lr"}
