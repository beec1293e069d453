"""Sparse-rollout correction: rejection and importance reweighting by the sparsity ratio.

For every response token, xi = pi_old / pi_sparse = exp(clamp(logp_old - logp_sparse, -20, 20)) says how
much the compressed KV cache changed the probability of the token it sampled. `correct` turns xi into
  * a new loss mask: tokens with xi outside [token_low, token_high] are dropped, and whole sequences are
    rejected when any token has xi < veto (the Sparse-RL veto) or when the geometric mean of xi over the
    sequence lies outside [geo_low, geo_high];
  * detached per-token weights min(xi, is_cap) on the surviving tokens, optionally divided by a global mean
    (`normalize_over`): "kept" divides by their mean over the surviving tokens of the minibatch (all DP ranks),
    so the surviving weights average 1; "all" (the reference recipe's, verl / slime) divides by the mean of
    min(xi, is_cap) over every response token, taken before any rejection or masking;
  * metrics, always including the mismatch diagnostics, even when the correction is off.
`low_xi_metrics` adds the share of tokens with xi < 0.1 (among positive-advantage ones, and overall); it needs
the advantages, so the trainer calls it apart, once they exist.

All decisions are taken on the clamped log-ratio, so thresholds are meaningful inside (e^-20, e^20);
a token the dense policy gives probability 0 (logp_old = -inf) clamps to xi = e^-20 and trips the veto.

Only the renormalization and the metrics need communication: one all-reduce of a small float64 vector of
sums (`reduce_sum`) and one of maxima (`reduce_max`). Rejection is per sequence and stays local.

Renormalized weights: before renormalization every weight is <= is_cap. After dividing by the global
mean m of the capped weights, the max is is_cap / m, which exceeds is_cap when m < 1. With token_low set,
surviving tokens have xi >= token_low, so m >= min(token_low, is_cap) and the max is <= is_cap / token_low.

`rejected_in_baseline` is read by the trainer, not here: True keeps rejected sequences in the group
baseline of the advantages (the paper); False recomputes advantages with `valid = ~seq_rejected`.

Left out on purpose: sequence-level IS (a product of T ratios: unbiased but its variance explodes with
length), IcePop-style weight zeroing (the token mask already does it), OPSM, and bypass mode (the
dense recompute of logp_old is always on, so the decoupled objective is the only one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from sparserl.algo.correction_config import CorrectionConfig

LOG_RATIO_CLAMP = 20.0
LOW_XI = 0.1  # the threshold of `low_xi_metrics`
# `low_xi_metrics`' tail quantiles of xi come from a histogram of log xi summed over DP ranks: bins of 0.002 over
# [-5, 5] (xi in [0.0067, 148]) plus one bin below and one above; a quantile is exact to ~0.2% of xi inside it.
_TAIL_LO, _TAIL_HI, _TAIL_BINS = -5.0, 5.0, 5000
TAIL_QUANTILES = {"mismatch/xi_p01": 0.01, "mismatch/xi_p05": 0.05}
Reduce = Callable[[Tensor], Tensor]


@dataclass
class Correction:
    """What the loss needs. All tensors are detached; weights are 1.0 wherever the new mask is 0."""

    weights: Tensor  # (B, T) importance weights for the policy loss
    mask: Tensor  # (B, T) float, the new loss mask
    seq_rejected: Tensor  # (B,) bool
    metrics: dict[str, float] = field(default_factory=dict)
    kl_weights: Tensor | None = None  # (B, T) = weights when cfg.apply_to_kl, else None
    norm_factor: float = 1.0  # what the capped weights were divided by
    kept_tokens: float = 0.0  # response tokens left in the loss mask, summed over DP ranks


@dataclass(frozen=True)
class DistReduceSum:
    """All-reduce (SUM) of a small tensor over `group`; the identity when torch.distributed is not up.

    Carries `reduce_max` too, so `correct(..., reduce_sum=dist_reduce_sum())` makes every metric global.
    """

    group: object = None

    def _all_reduce(self, x: Tensor, op: dist.ReduceOp) -> Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return x
        y = x.clone()
        dist.all_reduce(y, op=op, group=self.group)
        return y

    def __call__(self, x: Tensor) -> Tensor:
        return self._all_reduce(x, dist.ReduceOp.SUM)

    def reduce_max(self, x: Tensor) -> Tensor:
        return self._all_reduce(x, dist.ReduceOp.MAX)


def dist_reduce_sum(group: object = None) -> DistReduceSum:
    return DistReduceSum(group)


@dataclass
class Decision:
    """Each filter's outcome for a (B, T) batch; `correct`, `token_decisions` and `explain` all take it from `_decide`."""

    keep: Tensor  # (B, T) bool: response token that survives every filter
    low: Tensor  # (B, T) bool: masked for xi < token_low
    high: Tensor  # (B, T) bool: masked for xi > token_high
    veto: Tensor  # (B,) bool
    geo: Tensor  # (B,) bool
    raw_weights: Tensor  # (B, T) min(xi, cap) on kept tokens, 1 elsewhere
    truncated: Tensor  # (B, T) bool: kept token whose weight was capped
    capped: Tensor  # (B, T) min(xi, cap) on every token (1 everywhere without a cap)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _decide(cfg: CorrectionConfig, log_xi: Tensor, on: Tensor) -> Decision:
    none_tok = torch.zeros_like(on)  # (B, T)
    none_seq = torch.zeros(on.shape[0], dtype=torch.bool, device=on.device)  # (B,)
    low = on & (log_xi < _log(cfg.token_low)) if cfg.token_low is not None else none_tok
    high = on & (log_xi > _log(cfg.token_high)) if cfg.token_high is not None else none_tok
    veto = (on & (log_xi < _log(cfg.veto))).any(-1) if cfg.veto else none_seq

    n_tok = on.sum(-1)  # (B,)
    geo_log = log_xi.sum(-1) / n_tok.clamp(min=1)  # (B,) log of the geometric mean of xi
    geo = none_seq.clone()
    if cfg.geo_low is not None:
        geo |= geo_log < _log(cfg.geo_low)
    if cfg.geo_high is not None:
        geo |= geo_log > _log(cfg.geo_high)
    geo &= n_tok > 0

    keep = on & ~low & ~high & ~(veto | geo)[:, None]  # (B, T)
    if cfg.is_cap:
        capped = torch.exp(log_xi).clamp(max=cfg.is_cap)  # (B, T)
        truncated = keep & (log_xi > _log(cfg.is_cap))
    else:
        capped, truncated = torch.ones_like(log_xi), none_tok
    raw = torch.where(keep, capped, torch.ones_like(capped))  # (B, T)
    return Decision(keep, low, high, veto, geo, raw, truncated, capped)


def log_ratio(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(log xi clamped, 0 off the mask; response-token mask as bool), both (B, T), without autograd."""
    dtype = torch.promote_types(logp_old.dtype, torch.float32)
    on = mask > 0
    diff = (logp_old.detach().to(dtype) - logp_sparse.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(on, diff, torch.zeros_like(diff)), on


@torch.no_grad()
def token_decisions(cfg: CorrectionConfig, logp_old: Tensor, logp_sparse: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The per-token part of `correct` for a few whole sequences: (kept (B, T) float mask, min(xi, cap) on kept
    tokens and 1 elsewhere). Every decision is local to a sequence; only the normalization of the weights needs
    the whole minibatch, which is what lets the fused path decide inside each micro-batch."""
    log_xi, on = log_ratio(logp_old, logp_sparse, mask)
    d = _decide(cfg, log_xi, on)
    return mask.detach().to(log_xi.dtype) * d.keep.to(log_xi.dtype), d.raw_weights


@torch.no_grad()
def explain(cfg: CorrectionConfig, logp_old: Tensor, logp_sparse: Tensor, mask: Tensor) -> tuple[Tensor, Decision]:
    """(clamped log xi (B, T), every filter's outcome): the decisions the loss takes, for logging them
    (sparserl/trainer/samples.py). Weights are before the batch normalization."""
    log_xi, on = log_ratio(logp_old, logp_sparse, mask)
    return log_xi, _decide(cfg, log_xi, on)


# Layout of the all-reduced float64 statistics vectors.
_SUMS = ("tok", "seq", "diff", "abs_diff", "k3", "nll_sparse", "nll_dense",
         "low", "high", "rejected", "veto", "geo", "kept", "w", "w2", "truncated", "w_all")
_MAXES = ("abs_diff", "w", "neg_w")


def _local_stats(log_xi: Tensor, on: Tensor, logp_old: Tensor, logp_sparse: Tensor,
                 d: Decision | None) -> tuple[Tensor, Tensor]:
    f = torch.float64
    lx = log_xi.to(f)  # (B, T)
    n_tok = on.sum(-1)  # (B,)
    has = n_tok > 0  # (B,)
    zero = torch.zeros((), dtype=f, device=lx.device)

    def seq_nll(logp: Tensor) -> Tensor:  # sum over sequences of the per-sequence token-mean NLL
        nll = torch.where(on, -logp.to(f), 0.0).sum(-1) / n_tok.clamp(min=1)  # (B,)
        return torch.where(has, nll, 0.0).sum()

    def tmax(x: Tensor, where: Tensor) -> Tensor:
        return torch.where(where, x, -math.inf).amax() if x.numel() else zero - math.inf

    s = {k: zero for k in _SUMS}
    s.update(tok=on.sum().to(f), seq=has.sum().to(f), diff=(-lx).sum(), abs_diff=lx.abs().sum(),
             k3=torch.where(on, torch.expm1(lx) - lx, 0.0).sum(),
             nll_sparse=seq_nll(logp_sparse), nll_dense=seq_nll(logp_old))
    m = {"abs_diff": tmax(lx.abs(), on), "w": zero - math.inf, "neg_w": zero - math.inf}
    if d is not None:
        w = d.raw_weights.to(f)  # (B, T)
        s.update(low=d.low.sum().to(f), high=d.high.sum().to(f), rejected=(d.veto | d.geo).sum().to(f),
                 veto=d.veto.sum().to(f), geo=d.geo.sum().to(f), kept=d.keep.sum().to(f),
                 w=torch.where(d.keep, w, 0.0).sum(), w2=torch.where(d.keep, w * w, 0.0).sum(),
                 truncated=d.truncated.sum().to(f), w_all=torch.where(on, d.capped.to(f), 0.0).sum())
        m.update(w=tmax(w, d.keep), neg_w=tmax(-w, d.keep))
    return torch.stack([s[k] for k in _SUMS]), torch.stack([m[k] for k in _MAXES])


def _metrics(s: dict[str, float], m: dict[str, float], norm_factor: float, with_correction: bool) -> dict[str, float]:
    tok, seq = max(s["tok"], 1.0), max(s["seq"], 1.0)
    out = {
        "mismatch/kl": s["diff"] / tok,
        "mismatch/k3_kl": s["k3"] / tok,
        "mismatch/abs_max": m["abs_diff"] if s["tok"] > 0 else 0.0,
        "mismatch/abs_mean": s["abs_diff"] / tok,
        "mismatch/log_ppl_sparse": s["nll_sparse"] / seq,
        "mismatch/log_ppl_dense": s["nll_dense"] / seq,
        "mismatch/log_ppl_diff": (s["nll_sparse"] - s["nll_dense"]) / seq,
    }
    if not with_correction:
        return out
    kept = s["kept"]
    out.update({
        "correction/weight_mean": s["w"] / kept / norm_factor if kept > 0 else 1.0,
        "correction/weight_min": -m["neg_w"] / norm_factor if kept > 0 else 1.0,
        "correction/weight_max": m["w"] / norm_factor if kept > 0 else 1.0,
        "correction/norm_factor": norm_factor,
        "correction/ess": s["w"] ** 2 / (kept * s["w2"]) if kept > 0 else 1.0,
        "correction/truncated_frac": s["truncated"] / tok,
        "correction/masked_low_frac": s["low"] / tok,
        "correction/masked_high_frac": s["high"] / tok,
        "correction/kept_token_frac": kept / tok,
        "correction/rejected_seq_frac": s["rejected"] / seq,
        "correction/veto_seq_frac": s["veto"] / seq,
        "correction/geo_rejected_seq_frac": s["geo"] / seq,
    })
    return out


def _identity(x: Tensor) -> Tensor:
    return x


@torch.no_grad()
def low_xi_metrics(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, advantages: Tensor,
                   reduce_sum: Reduce | None = None) -> dict[str, float]:
    """How many sampled tokens the dense policy finds far less likely than the sampler did (xi < LOW_XI).

    `mismatch/low_xi_pos_adv_frac`: among response tokens of sequences with a positive advantage, the fraction
    with xi < 0.1. An uncorrected update raises the log-prob of every positive-advantage token, and a token
    that the compressed sampler drew at >= 10x the dense probability is where that push moves the dense policy
    furthest from what it would have sampled (the Sparse-RL veto and token mask drop exactly these).
    `mismatch/low_xi_frac`: the same over all response tokens. Both are taken on `mask` as given (pass the
    response mask, not a corrected one); `advantages` is (B,), (B, 1) or (B, T). Needs the advantages, so the
    trainer calls it once they exist, apart from `correct`.
    """
    reduce_sum = reduce_sum or _identity
    log_xi, on = log_ratio(logp_old, logp_sparse, mask)  # (B, T)
    adv = advantages.detach()
    adv = adv.reshape(-1, 1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    pos = on & (adv > 0)  # (B, T)
    low = log_xi < math.log(LOW_XI)  # (B, T)
    f = torch.float64
    sums = torch.stack([on.sum().to(f), (on & low).sum().to(f), pos.sum().to(f), (pos & low).sum().to(f)])
    s = reduce_sum(torch.cat([sums, _log_xi_histogram(log_xi[on])]))
    tok, tok_low, pos_tok, pos_low = s[:4].tolist()
    out = {"mismatch/low_xi_frac": tok_low / tok if tok else 0.0,
           "mismatch/low_xi_pos_adv_frac": pos_low / pos_tok if pos_tok else 0.0}
    return out | {name: histogram_quantile(s[4:], q) for name, q in TAIL_QUANTILES.items()}


def _log_xi_histogram(log_xi: Tensor) -> Tensor:
    """(BINS + 2,) float64 counts of `log_xi` (1-D): one below the range, the bins, one above."""
    width = (_TAIL_HI - _TAIL_LO) / _TAIL_BINS
    idx = ((log_xi.double() - _TAIL_LO) / width).floor().clamp(-1, _TAIL_BINS).long() + 1
    return torch.bincount(idx, minlength=_TAIL_BINS + 2).to(torch.float64)


def histogram_quantile(hist: Tensor, q: float) -> float:
    """The q-quantile of xi from `_log_xi_histogram` counts, linear in log xi inside its bin (NaN when empty;
    the range's end when it falls outside: at most exp(-5) or at least exp(5))."""
    hist = hist.cpu()  # one copy of BINS + 2 counts; the lookups below are host arithmetic
    total = float(hist.sum())
    if total == 0:
        return math.nan
    cum = torch.cumsum(hist, 0)
    rank = q * total
    i = int(torch.searchsorted(cum, torch.tensor([rank], dtype=cum.dtype)).item())
    if i == 0:
        return math.exp(_TAIL_LO)
    if i > _TAIL_BINS:
        return math.exp(_TAIL_HI)
    width = (_TAIL_HI - _TAIL_LO) / _TAIL_BINS
    before = float(cum[i - 1])
    frac = (rank - before) / float(hist[i]) if float(hist[i]) else 0.0
    return math.exp(_TAIL_LO + (i - 1 + frac) * width)


def correct(
    cfg: CorrectionConfig,
    logp_old: Tensor,
    logp_sparse: Tensor,
    mask: Tensor,
    reduce_sum: Reduce | None = None,
    reduce_max: Reduce | None = None,
) -> tuple[Correction, dict[str, float]]:
    """Correction for a rollout: logp_old, logp_sparse, mask are (B, T), response-aligned and padded.

    `reduce_sum` / `reduce_max` all-reduce a small 1-D tensor across DP ranks (default: this rank only;
    `reduce_max` defaults to `reduce_sum.reduce_max` when present). Fractions are over the response tokens
    (token metrics) or the sequences with at least one response token (sequence metrics) of the whole
    batch. In "measure" mode the correction metrics say what "apply" would have done.
    """
    if not (logp_old.shape == logp_sparse.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(f"correct: logp_old {tuple(logp_old.shape)}, logp_sparse {tuple(logp_sparse.shape)} "
                         f"and mask {tuple(mask.shape)} must all be the same (B, T)")
    reduce_max = reduce_max or getattr(reduce_sum, "reduce_max", None) or _identity
    reduce_sum = reduce_sum or _identity

    with torch.no_grad():
        log_xi, on = log_ratio(logp_old, logp_sparse, mask)  # (B, T)
        dtype = log_xi.dtype
        decision = _decide(cfg, log_xi, on) if cfg.enable else None

        sums, maxes = _local_stats(log_xi, on, logp_old.detach(), logp_sparse.detach(), decision)
        s = dict(zip(_SUMS, reduce_sum(sums).tolist()))
        m = dict(zip(_MAXES, reduce_max(maxes).tolist()))
        norm_factor = 1.0
        if decision is not None and cfg.is_batch_normalize:
            if cfg.normalize_over == "all" and s["tok"] > 0:
                norm_factor = s["w_all"] / s["tok"]
            elif cfg.normalize_over == "kept" and s["kept"] > 0:
                norm_factor = s["w"] / s["kept"]
        metrics = _metrics(s, m, norm_factor, with_correction=decision is not None)

        if decision is not None and cfg.mode == "apply":
            weights = torch.where(decision.keep, decision.raw_weights / norm_factor, torch.ones_like(log_xi))
            new_mask = mask.detach().to(dtype) * decision.keep.to(dtype)
            rejected = decision.veto | decision.geo
            kept = s["kept"]
        else:
            weights = torch.ones_like(log_xi)
            new_mask = mask.detach().to(dtype)
            rejected = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
            kept, norm_factor = s["tok"], 1.0

    kl_weights = weights if cfg.apply_to_kl and decision is not None and cfg.mode == "apply" else None
    return Correction(weights, new_mask, rejected, metrics, kl_weights, norm_factor, kept), metrics
