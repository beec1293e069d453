"""StreamingLLM: keep the first `sinks` tokens (attention sinks) and the most recent ones; a baseline.

Scores are logical positions (recency), with the `sinks` oldest candidates of each head lifted above every
other candidate, so a top-k keeps exactly the sinks plus the most recent tokens. Scores stay finite so they
can be normalized and summed over heads and layers for shared sets.

Left out on purpose: any use of keys or queries, and re-rotating kept keys to contiguous positions
(tokens keep their true logical positions, so no RoPE fix-up is needed).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparserl.kv.base import KVPolicyConfig, register_policy, window_len


@register_policy("streaming")
def streaming_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    n_cand = keys.shape[1] - window_len(cfg, keys.shape[1])
    cand_pos = positions[:, :n_cand]  # (H_kv, C)
    recency = cand_pos.float()
    if n_cand == 0:
        return recency
    age_rank = cand_pos.argsort(dim=-1).argsort(dim=-1)  # 0 = oldest candidate of the head
    above_all = recency.amax(dim=-1, keepdim=True) + 1.0
    return torch.where(age_rank < cfg.sinks, above_all, recency)
