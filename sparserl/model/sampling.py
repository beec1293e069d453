"""The sampling transform, shared by the engines' samplers and the actor's dense recompute.

`processed_logprobs` is the one definition of "the distribution that drew the token": logits / temperature,
restricted to the top-k and then the top-p (nucleus) kept set, renormalized. The actor calls the same
function on its dense logits so that `xi = exp(logp_old - logp_sparse)` measures compression, not the
truncation.

No device-to-host synchronization: whether any row truncates is a host fact (the settings come from
Python numbers: the config, a request's `SamplingParams`), so it is decided from those numbers, or given by
the caller as `truncate=` when the settings are already device tensors. With tensors and no `truncate`,
the sorted filter runs for every row: rows with top_k = 0 and top_p = 1 keep every token, exactly as the
unfiltered path does (up to the order of the softmax sum). The actor calls this once per LM-head chunk,
the samplers once per decode step; a blocking `.item()` in either stalls the device pipeline every call.
Left out on purpose: repetition / presence penalties and min-p (not part of RL rollouts here).
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")

Setting = torch.Tensor | float | int


def truncates(top_p: Setting, top_k: Setting) -> bool | None:
    """Whether top-k / top-p can drop a token, decided on the host; None when a setting is a tensor."""
    if isinstance(top_p, torch.Tensor) or isinstance(top_k, torch.Tensor):
        return None
    return float(top_p) < 1.0 or int(top_k) > 0


def processed_logprobs(
    logits: torch.Tensor,  # (B, V) any float dtype
    temperature: Setting,  # (B,) or scalar; 0 means greedy -> reported at temperature 1
    top_p: Setting = 1.0,  # (B,) or scalar
    top_k: Setting = 0,  # (B,) or scalar; 0 = off
    truncate: bool | None = None,  # does any row use top-k / top-p? None: decide from scalars, else filter all
) -> torch.Tensor:  # (B, V) float32 (float64 for float64 logits) log-probs, -inf outside the kept set
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32, or float64 when given
    B = logits.shape[0]
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=logits.device, dtype=logits.dtype).expand(B)
        logits = logits / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    elif float(temperature) > 0 and float(temperature) != 1.0:
        # An elementwise division by a (B, 1) tensor, as for per-row settings: a Python-scalar divisor would be
        # a multiply by its reciprocal, one ulp away from what the samplers compute.
        logits = logits / torch.full((B, 1), float(temperature), dtype=logits.dtype, device=logits.device)
    if truncate is None:
        truncate = truncates(top_p, top_k)
    if truncate is None or truncate:
        # Scalar settings become fill kernels on the logits' device, not host-to-device copies (a copy from
        # pageable host memory waits for the device's queue: a sync per call on CUDA).
        top_k = _per_row(top_k, B, torch.long, logits.device)
        top_p = _per_row(top_p, B, torch.float32, logits.device)
        logits = _filter_sorted(logits, top_k, top_p)
    return torch.log_softmax(logits, dim=-1)


def _per_row(value: Setting, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(B)
    return torch.full((B,), value, dtype=dtype, device=device)


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, NEG_INF), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays. Rows with
    # top_p = 1 skip this test: a cumulative sum can round up to 1 before the last token.
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
