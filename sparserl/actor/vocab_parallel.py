"""Log-probs and entropy from vocabulary-sharded logits, without ever gathering the full vocabulary.

With the LM head split by vocabulary over tp (tp_plans.py, `vocab_head`), rank r holds the logits of ids
[start, start + V_r). A token's log-prob is `z_target - logZ` with `logZ = m + log(sum_r sum exp(z - m))`, so
the ranks exchange only per-row numbers: one all-reduce MAX of the row maxima and one all-reduce SUM of
(sum-exp, the target logit from the rank that owns it, sum exp(z - m) * z). Entropy is
`logZ - E_p[z]`. The backward is local to each shard (every rank holds the same replicated loss, as in
Megatron's vocab-parallel cross-entropy), so it needs no communication.

Left out on purpose: top-p / top-k (the kept set depends on a global sort of the vocabulary; training
rollouts default to top-p 1, top-k 0), and fusing the LM-head matmul into the log-softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTR = "sparserl_vocab_shard"


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary in the LM head's output: ids [start, start + size)."""

    start: int
    size: int
    group: object  # the tp ProcessGroup


def vocab_shard(model: torch.nn.Module) -> VocabShard | None:
    """The shard `parallelize` recorded on a model whose LM head it split over tp; None otherwise."""
    return getattr(model, ATTR, None)


def vocab_parallel_logprobs(
    local_logits: torch.Tensor,  # (N, V_r) this rank's vocabulary columns, any float dtype
    targets: torch.Tensor,  # (N,) global token ids
    vocab_start: int,
    group,
    temperature: float = 1.0,  # 0 means greedy: reported at temperature 1, as processed_logprobs does
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns float32 log-probs (N,) of `targets` and, if asked, entropies (N,); differentiable w.r.t. the logits."""
    temperature = float(temperature) if temperature and temperature > 0 else 1.0
    logp, ent = _VocabParallelLogProbs.apply(local_logits, targets, vocab_start, group, temperature, with_entropy)
    return logp, (ent if with_entropy else None)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group, temperature, with_entropy):
        z = logits.float() / temperature  # (N, V_r)
        N, V_r = z.shape
        m = z.amax(-1) if V_r else z.new_full((N,), float("-inf"))  # (N,)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        e = torch.exp(z - m[:, None])  # (N, V_r)
        local = targets - start
        owned = (local >= 0) & (local < V_r)
        z_t = z.gather(-1, local.clamp(0, max(V_r - 1, 0))[:, None]).squeeze(-1) if V_r else z.new_zeros(N)
        sums = torch.stack([e.sum(-1), torch.where(owned, z_t, torch.zeros_like(z_t))])  # (2, N)
        if with_entropy:
            sums = torch.cat([sums, (e * z).sum(-1)[None]])  # (3, N)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_z = m + sums[0].log()  # (N,)
        logp = sums[1] - log_z
        mean_z = sums[2] / sums[0] if with_entropy else torch.zeros_like(log_z)  # E_p[z]
        ent = log_z - mean_z
        ctx.save_for_backward(logits, local, owned, log_z, mean_z)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(*(() if with_entropy else (ent,)))
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local, owned, log_z, mean_z = ctx.saved_tensors
        z = logits.float() / ctx.temperature
        p = torch.exp(z - log_z[:, None])  # (N, V_r) this shard's probabilities
        grad = torch.zeros_like(z)
        if g_logp is not None:  # d logp / dz = onehot - p
            grad -= g_logp[:, None] * p
            if grad.shape[1]:  # fixed shapes, no host sync: rows whose target another rank owns add 0
                owned_g = torch.where(owned, g_logp, torch.zeros_like(g_logp))
                grad.scatter_add_(1, local.clamp(0, grad.shape[1] - 1)[:, None], owned_g[:, None])
        if g_ent is not None:  # d H / dz_j = p_j (E_p[z] - z_j)
            grad += g_ent[:, None] * p * (mean_z[:, None] - z)
        return (grad / ctx.temperature).to(logits.dtype), None, None, None, None, None


def copy_to_vocab_parallel(hidden: torch.Tensor, group) -> torch.Tensor:
    """Identity on the replicated hidden states that feed a vocabulary-split LM head; backward sums their gradient
    over tp (each rank's gradient covers only its vocabulary rows)."""
    return _SumGradOverTP.apply(hidden, group)


class _SumGradOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        _all_reduce(grad, dist.ReduceOp.SUM, ctx.group)
        return grad, None


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
