"""The critic's objective for one micro-batch, and the statistics of its values against their targets.

    loss = 0.5 * agg(max((V - R)^2, (V_clip - R)^2)),  V_clip = V_old + clip(V - V_old, -clip, +clip)

V: the critic's values in the update (with a gradient), V_old: its values before the update (those GAE read), R: the
targets (`advantages.gae_returns`), agg: `aggregation.aggregate(loss_agg, ., mask, norm)` with the global minibatch
counts, so micro-batch shares add up over micro-batches and ranks as the actor's loss does. `clip=None` drops the
clipped term (plain squared error). The max keeps the larger error, so a value pushed past the clip range by the
update gets no further gradient in that direction (PPO's value clipping).

`mask` is the actor's loss mask at the update: the sequences the sparsity correction rejects and the tokens it masks
are out of it, so they do not train the critic either. The correction's importance weights do not scale this loss
(docs/decisions.md): they reweight an action's likelihood, and a value regression has none.

Metrics: "critic/value_loss" (this micro-batch's share: summed) and "critic/clip_frac" (a masked mean: averaged).
Left out on purpose: a value coefficient (the critic has its own optimizer and learning rate) and Huber losses.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparserl.algo.aggregation import Normalizer, aggregate, masked_mean
from sparserl.algo.correction import Reduce

SUMMED = frozenset({"critic/value_loss"})


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, norm: Normalizer,
               clip: float | None = 0.5, loss_agg: str = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """The scalar loss of one micro-batch (all inputs (b, T)) and its metrics as detached 0-dim tensors."""
    old, ret = old_values.detach(), returns.detach()
    err = (values - ret) ** 2  # (b, T)
    if clip is None:
        tok, clipped = err, torch.zeros_like(err)
    else:
        v_clip = old + (values - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2  # (b, T)
        tok = torch.maximum(err, err_clip)
        clipped = (err_clip > err).to(err.dtype)
    loss = 0.5 * aggregate(loss_agg, tok, mask, norm)
    return loss, {"critic/value_loss": loss.detach(), "critic/clip_frac": masked_mean(clipped, mask).detach()}


def value_stats(values: Tensor, returns: Tensor, mask: Tensor, reduce_sum: Reduce) -> dict[str, float]:
    """Over the masked tokens of every DP rank (`reduce_sum`), in float64: the explained variance
    1 - Var(R - V) / Var(R) of the values the advantages read (1: perfect, 0: no better than the mean, < 0: worse),
    and the mean value and target. One all-reduce of six sums."""
    w = (mask > 0).to(torch.float64)
    v, r = values.detach().to(torch.float64) * w, returns.detach().to(torch.float64) * w
    d = r - v
    sums = reduce_sum(torch.stack([w.sum(), v.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]))
    n, sv, sr, srr, sd, sdd = sums.tolist()
    n = max(n, 1.0)
    var_r = srr / n - (sr / n) ** 2
    var_d = sdd / n - (sd / n) ** 2
    explained = 1.0 - var_d / var_r if var_r > 0 else 0.0
    return {"critic/explained_var": explained, "critic/value_mean": sv / n, "critic/return_mean": sr / n}
