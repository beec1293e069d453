"""Per-token log-probs (and entropy) of response tokens over one packed micro-batch.

Sequences are concatenated into one `(1, L)` row with positions restarting at 0 per sequence; the
attention function (model/attention.py, the same one the engine runs) keeps each sequence causal
and separate. Log-probs use the sampler's transform (`processed_logprobs`), so they are comparable with the
engine's `logp_sparse`.

Shared prompts (`share_prompts`, the default): sequences of the micro-batch that start with the same prompt
(GRPO's n samples of one prompt) are laid out as the prompt once, then each response with positions continuing
after the prompt; a response's rows attend over the prompt's rows and causally over themselves, and its first
token is predicted from the prompt's last row. Every response sees exactly the context it saw unshared, so
log-probs and gradients are the same up to floating-point summation order, while the prompt's tokens are
computed once per micro-batch instead of once per sample (GRPO with 8 samples of ~40-token prompts and
~25-token answers: ~240 tokens instead of ~520).

The LM head never materializes the (tokens x vocabulary) logits of a whole micro-batch. `install_logprob_head`
replaces the head's forward: when the forward context carries a `LogprobHead` (the actor's forwards), the head
takes the hidden states of the rows that predict response tokens and computes matmul -> sampling transform ->
gather (+ entropy) `chunk` rows at a time; with autograd on, each chunk is checkpointed (only its input rows are
kept, and backward recomputes its logits), so the extra memory is O(chunk x V) instead of O(N x V), in the
forward and in the backward. In the usual case (temperature only, entropy as a metric) the chunks run inside one
autograd function with a hand-written backward (`_FusedHead`), which reuses one set of chunk buffers.
Outside such a forward the head is the plain linear layer it was. `chunk` comes from `actor.logprob_chunk_mb`,
by device unless set (`chunk_mb_for`). When `parallelize` split the LM head by vocabulary over tp, each chunk's
logits are this rank's (c, V/tp) slice and the log-probs come from `vocab_parallel_logprobs` (temperature only).
Left out on purpose: a fused Triton/CUDA kernel (the chunked matmul is already what bounds memory; a kernel
would save the recomputed matmul), and models that post-process logits after the head (final logit
soft-capping), which raise.
"""
from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sparserl.actor.context_parallel import CPAttention, CPGroup, gather_kept, kept_rows, zigzag_plan
from sparserl.actor.vocab_parallel import VocabShard, copy_to_vocab_parallel, vocab_parallel_logprobs, vocab_shard
from sparserl.model.attention import (ATTN_NAME, ForwardContext, Span, current_context, forward_context,
                                               use_packed_attention)
from sparserl.model.sampling import processed_logprobs, truncates

HEAD_ATTR = "sparserl_logprob_head"
SHARD_ATTR = "sparserl_vocab_shard"  # set on a vocabulary-split head by parallelize
DEFAULT_CHUNK_MB: float | None = None  # by device: `chunk_mb_for`
CHUNK_MB_CUDA = 1024.0  # a GPU has the memory, and its GEMMs want rows: ~1700 rows of a 152k vocabulary
CHUNK_MB_OTHER = 64.0


@dataclass
class PackedSeqs:
    """Sequences of one micro-batch: full token ids (prompt + response) and where the response starts."""

    ids: list[list[int]]
    prompt_lens: list[int]

    @property
    def resp_lens(self) -> list[int]:
        return [len(x) - p for x, p in zip(self.ids, self.prompt_lens)]


def chunk_mb_for(chunk_mb: float | None, device: torch.device) -> float:
    """`actor.logprob_chunk_mb` on `device`: None (the default) is `CHUNK_MB_CUDA` on CUDA, else `CHUNK_MB_OTHER`."""
    return float(chunk_mb) if chunk_mb is not None else CHUNK_MB_CUDA if device.type == "cuda" else CHUNK_MB_OTHER


def host_to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (or CPU tensor) on `device` without a stream sync: on CUDA pinned and copied asynchronously (the
    caching host allocator keeps the pinned buffer until the copy has run)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def chunk_rows(vocab_local: int, chunk_mb: float) -> int:
    """Rows per chunk so that one float32 (rows, V_local) buffer stays within `chunk_mb`; 0 MB = no chunking."""
    if chunk_mb <= 0:
        return 1 << 62
    return max(1, int(chunk_mb * 2**20) // (4 * max(vocab_local, 1)))


@dataclass
class LogprobHead:
    """What the LM head computes in an actor forward instead of logits; the results land in `logp` / `entropy`."""

    targets: torch.Tensor  # (N,) the token each kept row predicts
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    with_entropy: bool = False
    entropy_grad: bool = True
    chunk_mb: float | None = DEFAULT_CHUNK_MB  # None: by device
    shard: VocabShard | None = None
    logp: torch.Tensor | None = None  # (N,) float32
    entropy: torch.Tensor | None = None  # (N,) float32

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        if self.shard is not None:
            h = copy_to_vocab_parallel(h, self.shard.group)
        rows = chunk_rows(weight.shape[0], chunk_mb_for(self.chunk_mb, weight.device))
        grad = torch.is_grad_enabled()
        if self._fused(h, bias, grad):
            self.logp, ent = _FusedHead.apply(h, weight, self.targets, float(self.temperature), rows, self.with_entropy)
            if self.with_entropy:
                self.entropy = ent
            return self.logp.detach().view(*hidden.shape[:-1], 1)
        outs = []
        for start in range(0, h.shape[0], rows):
            args = (h[start : start + rows], weight, bias, self.targets[start : start + rows])
            # Checkpointed: the chunk's logits and softmax are freed now and recomputed in backward.
            outs.append(checkpoint(self._chunk, *args, use_reentrant=False) if grad else self._chunk(*args))
        # No rows (a context-parallel rank holding none of the kept rows): still a function of `hidden`, so that
        # backward runs through this rank's forward, whose ring attention and FSDP2 reductions are collectives.
        dtype = torch.float32 if self.shard is not None else torch.promote_types(h.dtype, torch.float32)
        empty = (h.sum() * 0).to(dtype).expand(0) if grad and h.requires_grad else h.new_zeros(0, dtype=dtype)
        self.logp = torch.cat([o[0] for o in outs]) if outs else empty
        if self.with_entropy:
            self.entropy = torch.cat([o[1] for o in outs]) if outs else empty
        # Stands in for the logits; callers read the fields. Detached: the loss reaches the graph through
        # `self.logp`, never through the model's output (a view of it would only draw FSDP2's view warning).
        return self.logp.detach().view(*hidden.shape[:-1], 1)

    def _fused(self, h: torch.Tensor, bias: torch.Tensor | None, grad: bool) -> bool:
        """Whether `_FusedHead` computes this head: temperature only (no top-p / top-k), the whole vocabulary on
        this rank, no bias, at least one row, and entropy without a gradient."""
        return (self.shard is None and bias is None and h.shape[0] > 0 and truncates(self.top_p, self.top_k) is False
                and not (grad and self.with_entropy and self.entropy_grad))

    def _chunk(self, h, weight, bias, tgt) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h, weight, bias)  # (c, V_local)
        if self.shard is not None:
            logp, ent = vocab_parallel_logprobs(logits, tgt, self.shard.start, self.shard.group, self.temperature,
                                                self.with_entropy)
            if ent is not None and not self.entropy_grad:
                ent = ent.detach()
            return logp, (ent if ent is not None else logp.new_zeros(0))
        logp_all = processed_logprobs(logits, self.temperature, self.top_p, self.top_k)  # (c, V) float32
        logp = logp_all.gather(-1, tgt[:, None]).squeeze(-1)  # (c,)
        ent = logp.new_zeros(0)
        if self.with_entropy:
            # Without a gradient (the usual case: entropy as a metric) this keeps no (c, V) autograd buffers.
            with torch.set_grad_enabled(self.entropy_grad and torch.is_grad_enabled()):
                p = logp_all.exp()
                # Zero the -inf log-probs of tokens outside the kept set first: where(p > 0, p * logp, 0)
                # would back-propagate 0 * -inf = NaN through the branch it does not take.
                ent = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)  # (c,)
        return logp, ent


class _HeadWorkspace:
    """The (rows, V) buffers one head pass reuses chunk after chunk: the logits, their log-probs, and a scratch
    buffer (probabilities, then gradients); plus a low-precision copy for GEMMs of bf16 / fp16 weights."""

    def __init__(self, rows: int, weight: torch.Tensor, acc: torch.dtype, temperature: float) -> None:
        V = weight.shape[0]
        self.z = weight.new_empty(rows, V, dtype=acc)
        self.lp = weight.new_empty(rows, V, dtype=acc)
        self.scratch = weight.new_empty(rows, V, dtype=acc)
        self.low = weight.new_empty(rows, V) if weight.dtype != acc else None
        # Division by a tensor, as processed_logprobs divides (a Python scalar would multiply by its reciprocal).
        self.temperature = (weight.new_full((1, 1), temperature, dtype=acc)
                            if temperature > 0 and temperature != 1.0 else None)

    def logprobs(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(c, V) log-probs of the chunk `h`, in `self.lp`: what processed_logprobs returns on its logits."""
        c = h.shape[0]
        if self.low is None:
            z = torch.mm(h, weight.t(), out=self.z[:c])
        else:
            z = self.z[:c].copy_(torch.mm(h, weight.t(), out=self.low[:c]))
        if self.temperature is not None:
            z.div_(self.temperature)
        return torch.log_softmax(z, dim=-1, out=self.lp[:c])

    def to_weight_dtype(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.low is None else self.low[: x.shape[0]].copy_(x)


class _FusedHead(torch.autograd.Function):
    """Log-probs of `targets` (and entropy as a metric) under the temperature-scaled LM head, `rows` rows at a time,
    with a hand-written backward that recomputes each chunk's logits (the (N, V) logits are never held).

    The same numbers as `LogprobHead._chunk` under checkpointing (the same GEMM, `log_softmax`, the same gradient
    g * (onehot - softmax) / T), with far less memory traffic: every chunk reuses one set of (rows, V) buffers
    instead of allocating ~8 fresh ones (each a page-faulted mapping on CPU), the softmax gradient is formed in
    place, and the weight's gradient accumulates over chunks in one buffer (`addmm_`) instead of one (V, H)
    tensor per chunk (docs/performance.md has its timing). Not used with top-p / top-k, a vocabulary-split head,
    a bias, or an entropy with a gradient."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, rows: int, with_entropy: bool):
        acc = torch.promote_types(h.dtype, torch.float32)
        N = h.shape[0]
        ws = _HeadWorkspace(min(rows, N), weight, acc, temperature)
        logp = h.new_empty(N, dtype=acc)
        ent = h.new_empty(N if with_entropy else 0, dtype=acc)
        for s in range(0, N, rows):
            e = min(s + rows, N)
            lp = ws.logprobs(h[s:e], weight)
            logp[s:e] = lp.gather(-1, targets[s:e, None]).squeeze(-1)
            if with_entropy:  # -sum p log p; no -inf entries without top-p / top-k, so no masking
                p = torch.exp(lp, out=ws.scratch[: e - s])
                ent[s:e] = torch.bmm(p.unsqueeze(1), lp.unsqueeze(2)).view(-1).neg()
        ctx.save_for_backward(h, weight, targets)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        h, weight, targets = ctx.saved_tensors
        if g_logp is None:
            return None, None, None, None, None, None
        acc = torch.promote_types(h.dtype, torch.float32)
        N, rows = h.shape[0], ctx.rows
        ws = _HeadWorkspace(min(rows, N), weight, acc, ctx.temperature)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        g_logp = g_logp.to(acc)
        for s in range(0, N, rows):
            e = min(s + rows, N)
            lp = ws.logprobs(h[s:e], weight)  # recomputed
            g = g_logp[s:e, None]
            # d logp[t] / d z = onehot(t) - softmax(z), times the incoming gradient, in place.
            grad = torch.exp(lp, out=ws.scratch[: e - s]).mul_(g).neg_()
            grad.scatter_add_(-1, targets[s:e, None], g)
            if ws.temperature is not None:  # z = logits / T
                grad.div_(ws.temperature)
            grad = ws.to_weight_dtype(grad)
            if dh is not None:
                torch.mm(grad, weight, out=dh[s:e])
            if dw is not None:
                dw.addmm_(grad.t(), h[s:e])
        return dh, dw, None, None, None, None


def _local(t):
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _head_forward(module: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    # Local tensors throughout: with tp the weight is this rank's vocabulary rows and the logits its slice.
    weight, bias, hidden = _local(module.weight), _local(module.bias), _local(hidden)
    ctx = current_context()
    if ctx is not None and ctx.head is not None:
        return ctx.head(hidden, weight, bias)
    shard = getattr(module, SHARD_ATTR, None)
    if shard is not None:
        hidden = copy_to_vocab_parallel(hidden, shard.group)
    return F.linear(hidden, weight, bias)


def install_logprob_head(model: torch.nn.Module) -> None:
    """Make the model's LM head computable in chunks (idempotent). Called before any parallelism is applied."""
    head = model.get_output_embeddings()
    if getattr(head, HEAD_ATTR, False):
        return
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}: the LM head is a {type(head).__name__}, expected nn.Linear")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__}: final logit soft-capping after the LM head is not supported")
    head.forward = functools.partial(_head_forward, head)
    setattr(head, HEAD_ATTR, True)


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
    chunk_mb: float | None = DEFAULT_CHUNK_MB,
    share_prompts: bool = True,
    cp: CPGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns response-aligned (b, T) log-probs and entropies (0 beyond each response's length).

    With `hold_context`, the forward context stays set until that stack closes: activation checkpointing
    recomputes the attention during backward, which must still see this micro-batch's spans.
    With `cp` (size > 1) every rank of the cp group passes the same `seqs`: each runs the model on its zigzag
    share of the packed row (actor/context_parallel.py) and computes the log-probs of the kept rows it holds; the
    results are all-gathered, so every rank returns the whole micro-batch's values, and the gradient of a loss on
    them flows back through each rank's own rows only.
    """
    install_logprob_head(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        use_packed_attention(model)  # the spans (and shared prompts) need the packed attention
    flat, pos, keep, targets, spans = _layout(seqs, share_prompts)
    shard = vocab_shard(model)
    if shard is not None and (top_p < 1.0 or top_k > 0):
        raise NotImplementedError(f"rollout.top_p={top_p} / rollout.top_k={top_k} with parallel.tp > 1: the kept set needs "
                                  "the full vocabulary, which a vocabulary-split LM head never gathers; use top_p=1, top_k=0")
    if cp is not None and cp.size > 1:
        logp, ent = _cp_forward(model, flat, pos, keep, targets, spans, device, cp, hold_context,
                                (temperature, top_p, top_k, with_entropy, entropy_grad, chunk_mb, shard))
    else:
        head = LogprobHead(host_to_device(targets, device), temperature, top_p, top_k, with_entropy,
                           entropy_grad, chunk_mb, shard)
        ctx = ForwardContext(spans=spans, head=head)
        with contextlib.ExitStack() as local:
            (hold_context or local).enter_context(forward_context(ctx))
            model(
                input_ids=host_to_device([flat], device),
                position_ids=host_to_device([pos], device),
                attention_mask=_no_mask(device),
                use_cache=False,
                logits_to_keep=host_to_device(keep, device),
            )
        logp, ent = head.logp, head.entropy
    ent = unflatten(ent, seqs.resp_lens) if with_entropy else None
    return unflatten(logp, seqs.resp_lens), ent


def _cp_forward(model, flat, pos, keep, targets, spans, device, cp: CPGroup, hold_context, head_args,
                make_head=LogprobHead):
    """The forward of one packed row split over the cp group: this rank's rows (ids, RoPE positions) by the zigzag
    plan, ring attention in every layer, the log-probs of the kept rows this rank holds, gathered in `keep` order.
    `make_head(targets, *head_args)`: what the kept rows compute (actor/reward.py passes its score head)."""
    plan = zigzag_plan(spans, cp.size)
    kept = kept_rows(plan, keep, cp.rank)
    ids = plan.shard(torch.tensor(flat), cp.rank, fill=0)
    positions = plan.positions(cp.rank, torch.tensor(pos))
    head = make_head(host_to_device(torch.tensor(targets)[kept.mine], device), *head_args)
    ctx = ForwardContext(head=head, cp=CPAttention(plan, cp.group))
    with contextlib.ExitStack() as local:
        (hold_context or local).enter_context(forward_context(ctx))
        model(
            input_ids=host_to_device(ids[None], device),
            position_ids=host_to_device(positions[None], device),
            attention_mask=_no_mask(device),
            use_cache=False,
            logits_to_keep=host_to_device(kept.local, device),
        )
    if head.entropy is None:
        return gather_kept(head.logp, kept, cp), None
    both = gather_kept(torch.stack([head.logp, head.entropy], 1), kept, cp)
    return both[:, 0], both[:, 1]


def _no_mask(device: torch.device) -> torch.Tensor:
    """A 4-D mask, which transformers' mask builders pass through untouched: without one they look for packed
    sequences in the positions with a host read (`find_packed_sequence_indices`) every forward. The packed
    attention (and ring attention) ignores it."""
    return torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)


def prompt_key(ids: list[int], prompt_len: int):
    """What makes two sequences share a prompt: the same prompt tokens."""
    return tuple(ids[:prompt_len])


def _layout(seqs: PackedSeqs, share_prompts: bool):
    """The packed row: token ids, positions, the rows whose hidden states predict the response tokens (in
    sequence order), those tokens, and the attention spans. See the module docstring for shared prompts."""
    groups: dict = {}
    for j, (ids, p) in enumerate(zip(seqs.ids, seqs.prompt_lens)):
        key = prompt_key(ids, p) if share_prompts and p > 0 else j
        groups.setdefault(key, []).append(j)
    flat: list[int] = []
    pos: list[int] = []
    spans: list[Span] = []
    keep_of: list[list[int]] = [[] for _ in seqs.ids]
    for members in groups.values():
        if len(members) == 1:
            j = members[0]
            ids, p = seqs.ids[j], seqs.prompt_lens[j]
            start = len(flat)
            flat.extend(ids)
            pos.extend(range(len(ids)))
            keep_of[j] = list(range(start + p - 1, start + len(ids) - 1))  # row t predicts token t + 1
            spans.append(Span(start, len(flat)))
            continue
        first = seqs.ids[members[0]]
        p = seqs.prompt_lens[members[0]]
        prompt_start = len(flat)
        flat.extend(first[:p])
        pos.extend(range(p))
        spans.append(Span(prompt_start, len(flat)))
        prompt_span = len(spans) - 1
        for j in members:
            ids = seqs.ids[j]
            if len(ids) == p:  # an empty response: nothing to attend or predict
                continue
            start = len(flat)
            flat.extend(ids[p:])
            pos.extend(range(p, len(ids)))
            keep_of[j] = [prompt_start + p - 1] + list(range(start, len(flat) - 1))
            spans.append(Span(start, len(flat), prefix=prompt_span))
    keep = [r for rows in keep_of for r in rows]
    targets = [t for ids, p in zip(seqs.ids, seqs.prompt_lens) for t in ids[p:]]
    return flat, pos, keep, targets, spans


def unflatten(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(sum(lengths),) -> (len(lengths), max(lengths)) zero-padded, differentiable."""
    T = max(lengths) if lengths else 0
    out = x.new_zeros(len(lengths), T)
    idx = host_to_device([i * T + j for i, n in enumerate(lengths) for j in range(n)], x.device)
    return out.view(-1).index_put((idx,), x).view(len(lengths), T)
