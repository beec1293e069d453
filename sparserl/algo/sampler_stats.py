"""The sparse sampler's mismatch as it sampled (`sampler/*`): every sampled token of every sequence whose dense
log-probs the step computed, before any filter chose what to train on.

The `mismatch/*` and `correction/*` metrics describe the batch the update trains on. Filters run before that batch
exists, and they are not neutral to the mismatch: dynamic sampling under the applied correction drops the groups it
rejects whole (and, with `rejected_in_baseline=false`, those left with at most one accepted sample), which are the
low-xi ones, and the rescue replaces rejected sequences with dense redraws (xi = 1). Over the trained batch the tail
of xi then reads higher than the sampler's. `SamplerStats` is fed wherever the trainer computes the dense log-probs of
sparse samples (each dynamic-sampling round's dense pass, the separate logp_old pass, the update's own forward on
the fused path; never the rescue's dense redraws) and gives, once per step over every DP rank:

  sampler/xi_p05, sampler/xi_p01  the tail quantiles of xi over the sampled tokens (what `rollout.kv.budget=auto`
                                  steers by, kv/budget_control.py);
  sampler/low_xi_frac             the share of them with xi < 0.1;
  sampler/rejected_seq_frac       the share of the scored sequences the correction rejects whole (its decision on
                                  the tokens it judges: a length-cut sequence under `algo.overlong.mask` has none);
  sampler/seqs, sampler/tokens    how many it covers.

The token set is one definition on every path: the model tokens of the responses as rolled out, length-cut ones
included (`TrainBatch.response_mask`), and with partial rollouts only those drawn in this step
(`TrainBatch.fresh_mask`): a carried token's xi also holds the policy updates since it was drawn, which no KV
budget changes (its staleness is in `partial/mismatch_kl_age*`). What it still does not see: samples that get no dense pass. Under dynamic
sampling without the applied correction, groups whose rewards tie are dropped before any dense pass; with it, the
rounds score only reward-informative groups. Scoring the rest would cost a dense forward over them every round.

Pure tensor code; the reduction over ranks is passed in.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from sparserl.algo.correction import LOW_XI, TAIL_QUANTILES, _log_xi_histogram, explain, histogram_quantile, log_ratio
from sparserl.algo.correction_config import CorrectionConfig

QUANTILES = {name.replace("mismatch/", "sampler/"): q for name, q in TAIL_QUANTILES.items()}  # sampler/xi_p01, _p05
_COUNTS = ("seqs", "tokens", "rejected", "low")


class SamplerStats:
    """`add` per dense pass over sparse samples, `metrics` once per step on every rank (a collective); it then
    starts over for the next step."""

    def __init__(self, cfg: CorrectionConfig) -> None:
        self.cfg = cfg
        self._acc: Tensor | None = None  # float64: the counts of _COUNTS, then the histogram of log xi

    @torch.no_grad()
    def add(self, logp_old: Tensor, logp_sparse: Tensor, response_mask: Tensor, trained_mask: Tensor | None = None) -> None:
        """One dense pass's (B, T) rows. `response_mask`: the sampled model tokens; `trained_mask`: the mask the
        correction judges (the loss mask after the length-cut mask, before the correction), default the same."""
        log_xi, on = log_ratio(logp_old, logp_sparse, response_mask)
        f = torch.float64
        rejected = torch.zeros((), dtype=f, device=log_xi.device)
        if self.cfg.enable:
            _, d = explain(self.cfg, logp_old, logp_sparse, response_mask if trained_mask is None else trained_mask)
            rejected = (d.veto | d.geo).sum().to(f)
        counts = torch.stack([on.any(-1).sum().to(f), on.sum().to(f), rejected,
                              (on & (log_xi < math.log(LOW_XI))).sum().to(f)])
        part = torch.cat([counts, _log_xi_histogram(log_xi[on])])
        self._acc = part if self._acc is None else self._acc + part.to(self._acc.device)

    def metrics(self, reduce_sum: Callable[[Tensor], Tensor], device) -> dict[str, float]:
        """The step's `sampler/*` metrics over every rank (each rank calls it, scored or not); resets."""
        acc = self._acc
        if acc is None:
            acc = torch.cat([torch.zeros(len(_COUNTS), dtype=torch.float64),
                             _log_xi_histogram(torch.zeros(0, dtype=torch.float64))])
        self._acc = None
        s = reduce_sum(acc.to(device))
        seqs, tokens, rejected, low = s[: len(_COUNTS)].tolist()
        hist = s[len(_COUNTS):]
        out = {"sampler/seqs": seqs, "sampler/tokens": tokens, "sampler/low_xi_frac": low / tokens if tokens else 0.0}
        out |= {name: histogram_quantile(hist, q) for name, q in QUANTILES.items()}
        if self.cfg.enable:
            out["sampler/rejected_seq_frac"] = rejected / seqs if seqs else 0.0
        return out

    def add_batch(self, logp_old: Tensor, batch, rows=None) -> None:
        """`add` for a `TrainBatch` and its dense log-probs `logp_old` (B, T); `rows`: only these (an index)."""
        take = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
        response = batch.response_mask if batch.response_mask is not None else batch.mask
        trained = batch.mask
        if batch.fresh_mask is not None:  # partial rollouts: the tokens drawn in this step only
            response, trained = response * batch.fresh_mask, trained * batch.fresh_mask
        self.add(take(logp_old), take(batch.logp_sparse), take(response), take(trained))
