"""Reducing per-token losses to a scalar, with normalizers that are global over the minibatch.

Every reduction divides by a count taken over the *whole* minibatch (all micro-batches on all DP ranks),
which the caller computes once before the update (`count_normalizer`). Each micro-batch then contributes
`aggregate(...)` and gradients are summed (accumulated locally, all-reduced with SUM across ranks), so

    sum over micro-batches and ranks of aggregate(x_mb, mask_mb, norm) == aggregate(x_full, mask_full, norm)

for any micro-batch split and any world size: the loss and the gradient do not depend on how the batch
was cut. (A per-micro-batch mean would weight short micro-batches' tokens more and break this.)

Left out on purpose: Dr.GRPO's constant "max response length" normalizer and verl's token-sum modes.
`token` (the DAPO token mean over the global batch) already removes the per-sequence length bias, and
a constant normalizer only rescales the learning rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

LossAgg = Callable[[Tensor, Tensor, "Normalizer"], Tensor]
LOSS_AGG: dict[str, LossAgg] = {}


@dataclass(frozen=True)
class Normalizer:
    """Global counts over one minibatch: trained tokens (sum of the loss mask) and sequences.

    `seqs` counts every sequence in the minibatch, including those whose mask is all zero (rejected by
    the correction): a rejected sequence contributes zero loss but is not dropped from the count, as in
    the reference Sparse-RL recipe. A count of 0 is treated as 1 (its numerator is 0 then too).
    """

    tokens: float
    seqs: float


def register_loss_agg(name: str) -> Callable[[LossAgg], LossAgg]:
    def deco(fn: LossAgg) -> LossAgg:
        if name in LOSS_AGG:
            raise ValueError(f"loss aggregation {name!r} is already registered")
        LOSS_AGG[name] = fn
        return fn

    return deco


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    # where() rather than x * mask alone: padding may hold inf/NaN (e.g. log-probs of pad tokens).
    return torch.where(mask > 0, x * mask, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask > 0; 0 (not NaN) for an empty mask."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1.0)


def metrics_to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """0-dim tensors -> python floats with a single device sync."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values))


def _safe(count: float) -> float:
    return count if count > 0 else 1.0


@register_loss_agg("token")
def token_mean(x: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    # (B, T) -> (): every trained token of the minibatch weighs the same.
    return masked_sum(x, mask) / _safe(norm.tokens)


@register_loss_agg("sequence")
def sequence_mean(x: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    # (B, T) -> (): token mean inside each sequence, then mean over sequences (GRPO's length normalization).
    per_tok = torch.where(mask > 0, x * mask, torch.zeros_like(x))  # (B, T)
    per_seq = per_tok.sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / _safe(norm.seqs)


def aggregate(name: str, x: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    """Reduce a (B, T) per-token quantity to this micro-batch's share of the minibatch scalar."""
    if name not in LOSS_AGG:
        raise ValueError(f"unknown loss aggregation {name!r} (algo.loss_agg); valid: {sorted(LOSS_AGG)}")
    if x.shape != mask.shape:
        raise ValueError(f"aggregate: x {tuple(x.shape)} and mask {tuple(mask.shape)} must have the same shape")
    return LOSS_AGG[name](x, mask, norm)


def count_normalizer(
    masks: Iterable[Tensor],
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
    device: torch.device | str | None = None,
) -> Normalizer:
    """Normalizer for a minibatch given the loss masks of all its local micro-batches (each (B_i, T_i)).

    `reduce_sum` sums a small 1-D tensor across DP ranks (see `correction.dist_reduce_sum`); without it
    the counts are this rank's only. A rank with no micro-batches still joins the reduction, on `device`.
    """
    counts = None
    for m in masks:
        c = torch.stack([m.detach().to(torch.float64).sum(), m.new_tensor(m.shape[0], dtype=torch.float64)])
        counts = c if counts is None else counts + c
    if counts is None:
        counts = torch.zeros(2, dtype=torch.float64, device=device)
    if reduce_sum is not None:
        counts = reduce_sum(counts)
    tokens, seqs = counts.tolist()
    return Normalizer(tokens=tokens, seqs=seqs)
