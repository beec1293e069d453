"""R-KV: keep keys that the recent queries attend to and that no newer key nearly duplicates.

score = lambda * importance - (1 - lambda) * redundancy, per KV head, over the candidate entries (all but the
observation window).

- importance: the window queries' attention over the candidates only. Window keys are left out of the
  softmax, as in the R-KV reference: they are kept anyway, and leaving them out keeps a few very recent
  high-attention tokens from flattening the distribution the candidates compete in. For GQA the logits are
  max-reduced over the query heads of a KV group before the softmax (the reference's "max" pooling), then
  averaged over the window rows and max-pooled along the token order with `kernel`.
- redundancy: cosine similarity of L2-normalized keys. Key j is penalized by every NEWER key i (by logical
  position) whose similarity exceeds `sim_threshold`: pen_j = mean_i sim_ij [sim_ij > thr][pos_i > pos_j],
  then softmax over all L entries. The newest key of any near-duplicate group is never penalized by its
  group, so the group keeps its newest member (the reference's retain_direction="last" intent).
  Deviation from the reference, on purpose: the reference averages raw cosines and zeroes, per row, only the
  newest similar entry, which leaves an exact pair of duplicates tied; here only above-threshold similarity
  from newer keys counts, so of two equal keys the older one always scores lower.

Left out on purpose: the reference's other retain directions and retain_ratio, sentence-level similarity,
and any sub-quadratic approximation: redundancy costs O(L^2 D) per head and trigger.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparserl.kv.base import KVPolicyConfig, attention_logits, pool_by_position, register_policy, window_len


def rkv_importance(keys: Tensor, queries: Tensor, positions: Tensor, n_cand: int, kernel: int) -> Tensor:
    """(H_kv, n_cand) attention mass the window queries put on each candidate, GQA-max, window-mean, pooled."""
    if n_cand == 0:
        return keys.new_zeros(keys.shape[0], 0)
    logits = attention_logits(keys[:, :n_cand], queries).amax(dim=1)  # (H_kv, W, C)
    attention = logits.softmax(dim=-1).mean(dim=1)  # (H_kv, C)
    return pool_by_position(attention, positions[:, :n_cand], kernel)


def rkv_redundancy(keys: Tensor, positions: Tensor, threshold: float) -> Tensor:
    """(H_kv, L) softmax-normalized penalty from newer near-duplicate keys (see the module docstring)."""
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    similarity = unit @ unit.transpose(-1, -2)  # (H_kv, L, L): [h, i, j] = cos(k_i, k_j)
    newer = positions.unsqueeze(-1) > positions.unsqueeze(-2)  # [h, i, j]: token i is newer than token j
    penalty = torch.where((similarity > threshold) & newer, similarity, 0.0).mean(dim=1)  # mean over rows i
    return penalty.softmax(dim=-1)


@register_policy("rkv")
def rkv_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    n_cand = keys.shape[1] - window_len(cfg, keys.shape[1])
    importance = rkv_importance(keys, queries, positions, n_cand, cfg.kernel)
    if cfg.mix_lambda == 1.0:  # the O(L^2) redundancy term would be multiplied by zero
        return importance
    redundancy = rkv_redundancy(keys, positions, cfg.sim_threshold)[:, :n_cand]
    return cfg.mix_lambda * importance - (1.0 - cfg.mix_lambda) * redundancy
