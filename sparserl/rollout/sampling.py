"""The sampling transform, shared by the engines' samplers and the actor's dense recompute.

`processed_logprobs` is the one definition of "the distribution that drew the token": logits / temperature,
restricted to the top-k and then the top-p (nucleus) kept set, renormalized. The actor calls the same
function on its dense logits so that `xi = exp(logp_old - logp_sparse)` measures compression, not the
truncation. Left out on purpose: repetition / presence penalties and min-p (not part of RL rollouts here).
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def processed_logprobs(
    logits: torch.Tensor,  # (B, V) any float dtype
    temperature: torch.Tensor | float,  # (B,) or scalar; 0 means greedy -> reported at temperature 1
    top_p: torch.Tensor | float = 1.0,  # (B,) or scalar
    top_k: torch.Tensor | int = 0,  # (B,) or scalar; 0 = off
) -> torch.Tensor:  # (B, V) float32 (float64 for float64 logits) log-probs, -inf outside the kept set
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32, or float64 when given
    B = logits.shape[0]
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device).expand(B)
    temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits / temperature[:, None]
    top_k = torch.as_tensor(top_k, device=logits.device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(B)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        logits = _filter_sorted(logits, top_k, top_p, need_k, need_p)
    return torch.log_softmax(logits, dim=-1)


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, need_k: bool, need_p: bool) -> torch.Tensor:
    V = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        drop |= rank >= k[:, None]
    if need_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, NEG_INF), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
