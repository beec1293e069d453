"""Per-token log-probs (and entropy) of response tokens over one packed micro-batch.

Sequences are concatenated into one `(1, L)` row with positions restarting at 0 per sequence; the
attention function (rollout/native/attention.py, the same one the engine runs) keeps each sequence causal
and separate, and the LM head runs only on the rows that predict response tokens. Log-probs use the
sampler's transform (`processed_logprobs`), so they are comparable with the engine's `logp_sparse`. When
`parallelize` split the LM head by vocabulary over tp, the logits are this rank's (N, V/tp) slice and the
log-probs come from `vocab_parallel_logprobs` (temperature only; top-p / top-k need the full vocabulary).
Left out on purpose: a chunked/fused LM-head + log-softmax (the logits of one micro-batch's response
tokens are materialized; bound them with actor.max_tokens_per_device).
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch

from sparserl.actor.vocab_parallel import vocab_parallel_logprobs, vocab_shard
from sparserl.rollout.native.attention import ForwardContext, Span, forward_context
from sparserl.rollout.sampling import processed_logprobs


@dataclass
class PackedSeqs:
    """Sequences of one micro-batch: full token ids (prompt + response) and where the response starts."""

    ids: list[list[int]]
    prompt_lens: list[int]

    @property
    def resp_lens(self) -> list[int]:
        return [len(x) - p for x, p in zip(self.ids, self.prompt_lens)]


def packed_logprobs(
    model: torch.nn.Module,
    seqs: PackedSeqs,
    device: torch.device,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    hold_context: contextlib.ExitStack | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns response-aligned (b, T) log-probs and entropies (0 beyond each response's length).

    With `hold_context`, the forward context stays set until that stack closes: activation checkpointing
    recomputes the attention during backward, which must still see this micro-batch's spans.
    """
    flat, pos, keep, targets, spans = [], [], [], [], []
    for ids, p in zip(seqs.ids, seqs.prompt_lens):
        start = len(flat)
        flat.extend(ids)
        pos.extend(range(len(ids)))
        keep.extend(range(start + p - 1, start + len(ids) - 1))  # row t predicts token t + 1
        targets.extend(ids[p:])
        spans.append(Span(start, len(flat)))
    ctx = ForwardContext(spans=spans)
    with contextlib.ExitStack() as local:
        (hold_context or local).enter_context(forward_context(ctx))
        out = model(
            input_ids=torch.tensor([flat], device=device),
            position_ids=torch.tensor([pos], device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, device=device),
        )
    tgt = torch.tensor(targets, device=device)
    shard = vocab_shard(model)
    if shard is not None:
        if top_p < 1.0 or top_k > 0:
            raise NotImplementedError(f"rollout.top_p={top_p} / rollout.top_k={top_k} with parallel.tp > 1: the kept set needs "
                                      "the full vocabulary, which a vocabulary-split LM head never gathers; use top_p=1, top_k=0")
        logp, ent = vocab_parallel_logprobs(out.logits[0], tgt, shard.start, shard.group, temperature, with_entropy)  # (N,)
        if ent is not None and not entropy_grad:
            ent = ent.detach()
        return unflatten(logp, seqs.resp_lens), (unflatten(ent, seqs.resp_lens) if ent is not None else None)
    logp_all = processed_logprobs(out.logits[0], temperature, top_p, top_k)  # (N, V) float32
    logp = logp_all.gather(-1, tgt[:, None]).squeeze(-1)  # (N,)
    ent = None
    if with_entropy:
        # Without a gradient (the usual case: entropy as a metric) this saves three (N, V) autograd buffers.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            p = logp_all.exp()
            ent = -torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)  # (N,)
    return unflatten(logp, seqs.resp_lens), (unflatten(ent, seqs.resp_lens) if ent is not None else None)


def unflatten(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(sum(lengths),) -> (len(lengths), max(lengths)) zero-padded, differentiable."""
    T = max(lengths) if lengths else 0
    out = x.new_zeros(len(lengths), T)
    idx = torch.cat([torch.arange(n, device=x.device) + i * T for i, n in enumerate(lengths)]) if lengths else x.new_zeros(0, dtype=torch.long)
    return out.view(-1).index_put((idx,), x).view(len(lengths), T)
