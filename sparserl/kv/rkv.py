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
  Deviation from the reference under variant=paper (the default), on purpose: the reference averages raw
  cosines and zeroes, per row, only the newest similar entry, which leaves an exact pair of duplicates tied;
  here only above-threshold similarity from newer keys counts, so of two equal keys the older one always
  scores lower.
- variant=reference (`rkv_reference_scores`): the same importance, and the reference's redundancy as its code
  computes it (`cal_similarity` in R-KV's rkv/utils.py and Sparse-RL's sglang-kvc r1kv_utils.py, retain_direction
  "last"): cosines with the diagonal zeroed; in row i, the entry of the newest key j with cos > `sim_threshold` is
  zeroed (with none above it, the entry of the oldest key, as its index arithmetic does); the column mean over all
  rows, every cosine counted, negative ones too; softmax over all L entries. "Newest" and "oldest" are by logical
  position, which is the reference's slot order in the caches both engines keep.

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


def rkv_reference_redundancy(keys: Tensor, positions: Tensor, threshold: float) -> Tensor:
    """(H_kv, L) the reference code's redundancy (see the module docstring), in slot order like `keys`."""
    order = positions.argsort(dim=-1)  # (H_kv, L): slot of the i-th oldest entry
    ordered = keys.gather(1, order.unsqueeze(-1).expand_as(keys))  # keys oldest first, as the reference holds them
    unit = ordered / (ordered.norm(dim=-1, keepdim=True) + 1e-8)
    similarity = unit @ unit.transpose(-1, -2)  # (H_kv, L, L)
    similarity.diagonal(dim1=-2, dim2=-1).zero_()
    index = torch.arange(keys.shape[1], device=keys.device)
    # Per row, the newest entry above the threshold; index 0 (the oldest) where none is, as the reference's max does.
    newest = torch.where(similarity > threshold, index, 0).amax(dim=-1, keepdim=True)  # (H_kv, L, 1)
    similarity.scatter_(-1, newest, 0.0)
    penalty = similarity.mean(dim=1).softmax(dim=-1)  # (H_kv, L), oldest first
    return torch.empty_like(penalty).scatter_(-1, order, penalty)


def rkv_mix(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor, redundancy_fn) -> Tensor:
    """lambda * importance - (1 - lambda) * redundancy over the candidates, with the variant's redundancy."""
    n_cand = keys.shape[1] - window_len(cfg, keys.shape[1])
    importance = rkv_importance(keys, queries, positions, n_cand, cfg.kernel)
    if cfg.mix_lambda == 1.0:  # the O(L^2) redundancy term would be multiplied by zero
        return importance
    redundancy = redundancy_fn(keys, positions, cfg.sim_threshold)[:, :n_cand]
    return cfg.mix_lambda * importance - (1.0 - cfg.mix_lambda) * redundancy


@register_policy("rkv")
def rkv_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    return rkv_mix(cfg, keys, queries, positions, rkv_redundancy)


@register_policy("rkv", variant="reference")
def rkv_reference_scores(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    return rkv_mix(cfg, keys, queries, positions, rkv_reference_redundancy)
