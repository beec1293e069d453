"""SnapKV: keep the candidates that the observation window "votes" for, re-applied at every decode trigger.

Each window query attends over ALL cached keys with a causal mask inside the window (as the original SnapKV
does at prefill); the probabilities are averaged over the query heads of a KV group (GQA: mean, as kvpress
does, unlike R-KV's max), summed over the window rows (the original's vote), restricted to the candidates
(all but the window), and max-pooled along the token order with `kernel`.

variant=reference: SnapKV as the R-KV code base and Sparse-RL's sglang-kvc run it at decode time, which is R-KV's
importance alone (`rkv_importance`): GQA max over the logits, a softmax over the candidates only (window keys
left out), the mean over the window rows, max-pooled.

Left out on purpose: average pooling (the original's default; the LongBench configs and R-KV's decode-time
adaptation use max), prompt-only application, and per-layer capacities.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparserl.kv.base import KVPolicyConfig, attention_logits, pool_by_position, register_policy, window_len
from sparserl.kv.rkv import rkv_importance


@register_policy("snapkv")
def snapkv_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    n_cached = keys.shape[1]
    n_query = queries.shape[1]
    n_cand = n_cached - window_len(cfg, n_cached)
    logits = attention_logits(keys, queries)  # (H_kv, G, W, L)
    # Window query w is the token in slot L - W + w: it must not see the window keys that came after it.
    query_slot = torch.arange(n_cached - n_query, n_cached, device=keys.device).unsqueeze(-1)  # (W, 1)
    future = torch.arange(n_cached, device=keys.device) > query_slot  # (W, L)
    attention = logits.masked_fill(future, float("-inf")).softmax(dim=-1).mean(dim=1)  # (H_kv, W, L)
    votes = attention[..., :n_cand].sum(dim=1)  # (H_kv, C)
    return pool_by_position(votes, positions[:, :n_cand], cfg.kernel)


@register_policy("snapkv", variant="reference")
def snapkv_reference_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    n_cand = keys.shape[1] - window_len(cfg, keys.shape[1])
    return rkv_importance(keys, queries, positions, n_cand, cfg.kernel)
