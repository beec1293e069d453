"""Actors of preference pairs: the reward model (a scalar head on the last token) and the pair planning it shares
with DPO.

Batches hold pairs as rows (2k, 2k + 1) = (chosen, rejected) of pair k, both starting with the pair's prompt.
`PairPlanning` packs micro-batches by pair (first-fit decreasing on the pair's tokens, the prompt counted once), so
both sequences of a pair always share a micro-batch, and with shared prompts (actor/logprobs.py) the prompt is
computed once for the two: a pair may reach twice a single sequence's length, and a pair longer than
`actor.max_tokens_per_device` gets a micro-batch of its own, never split.

The reward model is the actor's causal LM with one more module, `score` (a bias-free Linear(hidden, 1), seeded),
added before parallelism (`Actor(extend=...)`), so loading, LoRA (the head trains beside the adapters), FSDP2 and
context parallelism are the actor's. Its forward replaces the LM head's computation (the forward context's head,
as the log-prob head does) by the score of each sequence's last token: the row that predicts the token after it.
`export_reward_model` writes `<Arch>ForSequenceClassification` (num_labels=1): the decoder's weights (adapters
merged) and `score.weight`; Hugging Face's own class then scores the last non-padding token, the same number.
With tensor parallelism the head is replicated over tp (`TP_PLAN`): every rank scores from the replicated last
hidden state, as the critic's value head does. `RewardModel(head_path=...)` reads the head back from an export
(`score.weight` of its safetensors): the learned reward of the RL trainer (trainer/learned_reward.py).
Left out on purpose: training on from an exported head (`sparserl.trainer.rm` starts from a causal LM; its head
from the seed).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from sparserl.actor.actor import Actor, TrainBatch
from sparserl.actor.parallelize import EXTRA_PLAN
from sparserl.actor.logprobs import (PackedSeqs, _cp_forward, _layout, _no_mask, host_to_device, install_logprob_head,
                                     unflatten)
from sparserl.data.packing import split_microbatches
from sparserl.model.attention import ATTN_NAME, ForwardContext, forward_context, use_packed_attention

SCORE = "score"  # the head's attribute on the model, and its name in the exported checkpoint (`score.weight`)
TP_PLAN = {SCORE: "replicate"}  # added to the model family's tensor-parallel plan (actor/parallelize.py EXTRA_PLAN)


class PairPlanning:
    """Micro-batches of whole pairs (mix into an `Actor`)."""

    def _plan(self, batch: TrainBatch, index: list[int]) -> list[list[int]]:
        pairs = sorted({i // 2 for i in index})
        assert len(index) == 2 * len(pairs), "a pair's chosen and rejected rows travel together"
        costs = [len(batch.ids[2 * k]) + len(batch.ids[2 * k + 1]) - batch.prompt_lens[2 * k] for k in pairs]
        return [[r for u in mb for r in (2 * pairs[u], 2 * pairs[u] + 1)] for mb in split_microbatches(costs, self.max_tokens)]


def add_score_head(model: torch.nn.Module, seed: int) -> None:
    """`model.score`: Linear(hidden, 1) without bias, drawn N(0, initializer_range) from `seed` (the same on every rank)."""
    hidden = model.config.hidden_size
    dtype = model.get_input_embeddings().weight.dtype
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    head = torch.nn.Linear(hidden, 1, bias=False, dtype=dtype, device=model.get_input_embeddings().weight.device)
    if head.weight.device.type != "meta":
        with torch.no_grad():
            head.weight.copy_(torch.randn(1, hidden, generator=gen, dtype=torch.float32) * std)
    setattr(model, SCORE, head)
    setattr(model, EXTRA_PLAN, TP_PLAN)


def exported_score(path: str) -> torch.Tensor:
    """`score.weight` (1, hidden) of a reward-model export's safetensors files (a ValueError naming the folder if
    none holds it)."""
    from pathlib import Path

    from safetensors import safe_open

    name = f"{SCORE}.weight"
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"{path}: no {name} in its safetensors files; a reward model is exported by sparserl.trainer.rm")


def load_score_head(model: torch.nn.Module, path: str) -> None:
    """`model.score` from the export at `path` (nothing to copy on the meta device: rank 0's values arrive later)."""
    add_score_head(model, seed=0)
    head = getattr(model, SCORE)
    if head.weight.device.type == "meta":
        return
    weight = exported_score(path)
    if weight.shape != head.weight.shape:
        raise ValueError(f"{path}: {SCORE}.weight has shape {tuple(weight.shape)}, the model's hidden size wants "
                         f"{tuple(head.weight.shape)}")
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))


class ScoreHead:
    """The forward context's head: the score of each kept row (N,) in `logp` (the field callers read)."""

    def __init__(self, targets, score: torch.nn.Linear) -> None:
        self.score = score
        self.logp: torch.Tensor | None = None
        self.entropy = None

    def __call__(self, hidden: torch.Tensor, weight, bias) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        w = self.score.weight
        w = w.to_local() if hasattr(w, "to_local") else w
        self.logp = F.linear(h, w.to(h.dtype)).squeeze(-1).to(torch.promote_types(h.dtype, torch.float32))  # (N,)
        return self.logp.detach().view(*hidden.shape[:-1], 1)



def head_rows(model, layout, device, cp, hold_context, weight, make_head) -> torch.Tensor:
    """The packed forward of `layout` (`_layout`'s five parts) with the LM head replaced by `make_head(None,
    weight)` (a scalar head: the score or the value), context-parallel when `cp` spans ranks; the head's rows."""
    flat, pos, keep, targets, spans = layout
    if cp is not None and cp.size > 1:
        rows, _ = _cp_forward(model, flat, pos, keep, targets, spans, device, cp, hold_context, (weight,),
                              make_head=make_head)
        return rows
    head = make_head(None, weight)
    with contextlib.ExitStack() as local:
        (hold_context or local).enter_context(forward_context(ForwardContext(spans=spans, head=head)))
        model(input_ids=host_to_device([flat], device), position_ids=host_to_device([pos], device),
              attention_mask=_no_mask(device), use_cache=False, logits_to_keep=host_to_device(keep, device))
    return head.logp

def packed_scores(model: torch.nn.Module, seqs: PackedSeqs, device: torch.device,
                  hold_context: contextlib.ExitStack | None = None, cp=None) -> torch.Tensor:
    """(b, 1) scores of the last token of each sequence of one packed micro-batch (prompts shared, as for log-probs).

    Each sequence gets one placeholder token appended: the rows kept are then those that predict the response
    tokens and the placeholder, and the last of them is the real last token's row. The placeholder's own row is
    computed and dropped; causal attention keeps it out of every other row."""
    install_logprob_head(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        use_packed_attention(model)
    padded = PackedSeqs([ids + [0] for ids in seqs.ids], seqs.prompt_lens)
    flat, pos, keep, targets, spans = _layout(padded, share_prompts=True)
    rows = head_rows(model, (flat, pos, keep, targets, spans), device, cp, hold_context, getattr(model, SCORE), ScoreHead)
    lens = padded.resp_lens
    per_seq = unflatten(rows, lens)  # (b, max resp + 1)
    last = host_to_device([n - 1 for n in lens], device)
    return per_seq.gather(1, last[:, None])  # (b, 1)


class PairActor(PairPlanning, Actor):
    """The policy of DPO: the actor, micro-batched by pair."""


class ScoreForward:
    """An `Actor` whose `_forward` returns (b, 1) scores where the actor returns log-probs (mix in before `Actor`), so
    the actor's micro-batching, gradient accumulation and optimizer step train it unchanged.

    `head_path`: an export whose score head is read (the model path itself: a frozen scorer); None: the head drawn
    from `seed` (a reward model to train)."""

    def __init__(self, *args, seed: int = 0, head_path: str | None = None, **kwargs) -> None:
        extend = (lambda m: load_score_head(m, head_path)) if head_path else (lambda m: add_score_head(m, seed))
        super().__init__(*args, seed=seed, extend=extend, **kwargs)

    def _forward(self, batch: TrainBatch, mb: list[int], with_entropy: bool, hold_context=None):
        seqs = PackedSeqs([[0, 0]], [1]) if not mb else PackedSeqs([batch.ids[i] for i in mb],
                                                                    [batch.prompt_lens[i] for i in mb])
        return packed_scores(self.model, seqs, self.device, hold_context, self.cp), None

    @torch.no_grad()
    def scores(self, batch: TrainBatch) -> torch.Tensor:
        """(B,) scores of every sequence under the current weights (eval mode for adapter dropout); None for an
        empty batch (whose rank still joins the other ranks' forwards)."""
        out = self.logprobs(batch)
        return out[:, 0] if out is not None else None


class RewardModel(PairPlanning, ScoreForward, Actor):
    """The reward model that `sparserl.trainer.rm` trains: micro-batched by pair."""


class RewardScorer(ScoreForward, Actor):
    """A frozen reward model scoring single sequences, micro-batched as the actor's (trainer/learned_reward.py)."""


def export_reward_model(cfg, model: RewardModel, tokenizer, rank: int) -> None:
    """output_dir/hf as `<Arch>ForSequenceClassification` (num_labels=1): the decoder (adapters merged) and the
    score head; a collective (every rank joins the gathers), rank 0 writes."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    from sparserl.actor.hf import export_hf
    from sparserl.utils.logging import log0

    state = {}
    for name, t in model.full_state().gather(keep=rank == 0):
        if rank == 0 and not name.startswith("lm_head."):
            state[name] = t.detach().cpu()
    if rank != 0:
        return
    config = type(model.config).from_dict(model.config.to_dict())
    config.num_labels = 1
    config.architectures = None
    if config.pad_token_id is None and tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(config)
    shell.config.dtype = str(state[f"{SCORE}.weight"].dtype).removeprefix("torch.")
    path = export_hf(shell, tokenizer, Path(cfg.trainer.output_dir) / "hf", state_dict=state)
    log0(f"exported the reward model to {path}")
