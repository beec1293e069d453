"""KV-compression core: the policy registry and the selection step every policy shares (the policy config,
`KVPolicyConfig`, lives in the torch-free sparserl/kv/policy.py and is re-exported here).

A policy scores the cached entries of ONE request in ONE layer; `select_keep` turns those scores into the
indices to keep. The caller (an engine) gathers keys/values at those indices and frees the rest.

Conventions every function here relies on:
- `keys` are post-RoPE and laid out per KV head in slot order; the last `min(window, L)` entries of every head
  are the most recent tokens, oldest first. The entries before them ("candidates") may hold different tokens
  per head; their true order is given by `positions`.
- Scores are float32, higher = keep. `score_tokens` reports the window entries at their head's best candidate
  score, so that normalizing a row (for shared sets) is not distorted by entries that are kept anyway.
- `variant` picks how a policy scores: `paper` as its paper describes it, `reference` exactly as the public code
  that Sparse-RL builds on does (R-KV's `rkv/utils.py` and `KVCluster` in Sparse-RL's sglang-kvc fork). A policy
  registers its reference scoring only where that code differs (`REFERENCE_POLICIES`); the others score the same
  under both. The reference code also sums raw scores over heads for its one shared set, so under `reference`
  shared sets sum raw scores (`KVPolicyConfig.normalize_sums`) instead of min-max-normalized ones.

Left out on purpose: values (no built-in policy reads them), anything about slots, pools or engines,
per-layer budgets (PyramidKV-style), and learned scorers.
"""
from __future__ import annotations

import importlib
import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sparserl.kv.policy import VARIANTS, KVPolicyConfig

# fn(cfg, keys (H_kv, L, D) f32, queries (H_q, W, D) f32, positions (H_kv, L) long) -> (H_kv, L - n_window) f32:
# scores of the candidate entries only; the window is handled by `score_tokens` / `select_keep`.
PolicyFn = Callable[["KVPolicyConfig", Tensor, Tensor, Tensor], Tensor]
POLICIES: dict[str, PolicyFn] = {}  # every policy, scoring as its paper describes (variant=paper)
REFERENCE_POLICIES: dict[str, PolicyFn] = {}  # variant=reference, only where the reference code scores differently


def register_policy(name: str, variant: str = "paper") -> Callable[[PolicyFn], PolicyFn]:
    """Decorator adding a scoring function under `name` (see `PolicyFn` for the contract).

    variant="paper" registers a new policy; variant="reference" adds the reference-code scoring of a policy
    already registered, used when `KVPolicyConfig.variant == "reference"`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"KV policy variant {variant!r} is not valid; valid: {', '.join(VARIANTS)}")

    def add(fn: PolicyFn) -> PolicyFn:
        if variant == "paper":
            if name == "none" or name in POLICIES:
                raise ValueError(f"KV policy name {name!r} is already taken")
            POLICIES[name] = fn
        else:
            if name not in POLICIES or name in REFERENCE_POLICIES:
                raise ValueError(f"KV policy {name!r}: a reference scoring needs the policy registered first, once")
            REFERENCE_POLICIES[name] = fn
        return fn

    return add


def register_builtins() -> None:
    """Import the built-in policies, which register themselves (`sparserl.kv` does it before handing out any of
    this module's names; `policy_fn` does it for code that imports this module directly)."""
    for name in ("rkv", "snapkv", "streaming"):
        importlib.import_module(f"sparserl.kv.{name}")


def policy_fn(cfg: KVPolicyConfig) -> PolicyFn:
    """The scoring function of `cfg.algorithm` under `cfg.variant` (the paper's where no reference one exists)."""
    if cfg.algorithm not in POLICIES:
        register_builtins()
    if cfg.variant == "reference" and cfg.algorithm in REFERENCE_POLICIES:
        return REFERENCE_POLICIES[cfg.algorithm]
    return POLICIES[cfg.algorithm]


def window_len(cfg: KVPolicyConfig, n_cached: int) -> int:
    return min(cfg.window, n_cached)


def attention_logits(keys: Tensor, queries: Tensor) -> Tensor:
    """q.k / sqrt(D) per KV group: keys (H_kv, L, D), queries (H_q, W, D) -> (H_kv, G, W, L), G = H_q // H_kv.

    Query head h reads KV head h // G, the layout Hugging Face's `repeat_kv` assumes.
    """
    n_kv, _, dim = keys.shape
    n_q, n_w, _ = queries.shape
    grouped = queries.reshape(n_kv, n_q // n_kv, n_w, dim)
    return grouped @ keys.transpose(-1, -2).unsqueeze(1) / math.sqrt(dim)


def pool_by_position(scores: Tensor, positions: Tensor, kernel: int) -> Tensor:
    """1-D max-pool (stride 1, same length) of (H, C) scores along each head's logical token order.

    Slots need not be in token order, so each row is sorted by position, pooled, and scattered back.
    """
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    order = positions.argsort(dim=-1)  # (H, C)
    ordered = scores.gather(-1, order)
    pooled = F.max_pool1d(ordered.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(0)
    return torch.empty_like(scores).scatter_(-1, order, pooled)


def normalize_rows(scores: Tensor) -> Tensor:
    """Min-max scale each row to [0, 1] (a constant row -> 0), so heads and layers weigh equally when summed."""
    low = scores.amin(dim=-1, keepdim=True)
    span = scores.amax(dim=-1, keepdim=True) - low
    return torch.where(span > 0, (scores - low) / span.clamp_min(torch.finfo(scores.dtype).tiny), 0.0)


def score_tokens(cfg: KVPolicyConfig, keys: Tensor, queries: Tensor, positions: Tensor) -> Tensor:
    """Scores (H_kv, L) float32, higher = keep, for one request in one layer.

    keys (H_kv, L, D) any float dtype; queries (H_q, W, D) of the last W <= min(window, L) tokens, H_q a
    multiple of H_kv; positions (H_kv, L) logical token positions. Window entries get the row's best candidate
    score (`select_keep` keeps them regardless).
    """
    if cfg.algorithm == "none":
        raise ValueError("KVPolicyConfig.algorithm='none' keeps the dense cache: there is nothing to score; "
                         "the engine must not call score_tokens without a compression policy")
    if keys.ndim != 3 or queries.ndim != 3 or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"expected keys (H_kv, L, D) and queries (H_q, W, D), got {tuple(keys.shape)} and "
                         f"{tuple(queries.shape)}")
    n_kv, n_cached, _ = keys.shape
    n_win = window_len(cfg, n_cached)
    if queries.shape[0] % n_kv != 0:
        raise ValueError(f"query heads ({queries.shape[0]}) must be a multiple of KV heads ({n_kv})")
    if not 1 <= queries.shape[1] <= n_win:
        raise ValueError(f"expected 1..{n_win} window queries, got {queries.shape[1]}")
    if tuple(positions.shape) != (n_kv, n_cached):
        raise ValueError(f"positions must be (H_kv, L) = {(n_kv, n_cached)}, got {tuple(positions.shape)}")

    candidates = policy_fn(cfg)(cfg, keys.float(), queries.float(), positions).float()
    assert candidates.shape == (n_kv, n_cached - n_win), f"policy {cfg.algorithm!r} returned {tuple(candidates.shape)}"
    if n_cached > n_win:
        window_score = candidates.amax(dim=-1, keepdim=True)
    else:
        window_score = candidates.new_zeros(n_kv, 1)
    return torch.cat([candidates, window_score.expand(n_kv, n_win)], dim=-1)


def select_keep(scores: Tensor, n_keep: int, window: int, shared: bool, normalize: bool = True) -> Tensor:
    """Indices to keep, (H_kv, n_keep) long, each row sorted ascending and unique.

    Per head: the last min(window, L) entries, plus the top (n_keep - window) other entries by score.
    shared=True picks one set for all heads from the sum of the head scores, each min-max-normalized first
    unless normalize=False (rows then equal); it assumes the heads hold the same tokens in the same slots, which a
    shared set guarantees. scores may carry leading batch dims, (..., H_kv, L) -> (..., H_kv, n_keep): requests
    of the same length, each selected on its own exactly as alone (every step works row by row).
    """
    *lead, n_heads, n_cached = scores.shape
    if n_keep >= n_cached:
        return torch.arange(n_cached, device=scores.device).expand(*lead, n_heads, n_cached).clone()
    n_win = min(window, n_cached)
    if n_keep < n_win:
        raise ValueError(f"n_keep={n_keep} is smaller than the observation window ({n_win}), which is always kept")
    n_cand = n_cached - n_win
    candidates = scores[..., :n_cand].float()
    if shared:
        candidates = (normalize_rows(candidates) if normalize else candidates).sum(dim=-2, keepdim=True)  # (..., 1, C)
    top = candidates.topk(n_keep - n_win, dim=-1, sorted=False).indices.sort(dim=-1).values
    recent = torch.arange(n_cand, n_cached, device=scores.device).expand(*top.shape[:-1], n_win)
    return torch.cat([top, recent], dim=-1).expand(*lead, n_heads, n_keep).contiguous()


def reduce_scores(scores_list: list[Tensor], normalize: bool = True) -> Tensor:
    """share=all: one score row set per request from every layer's (H_kv or 1, L) scores.

    Each layer is min-max-normalized per row before the sum so no layer dominates by scale (normalize=False:
    raw sums); the result has the broadcast shape, (H_kv, L) or (1, L), and goes to
    `select_keep(..., shared=True)`.
    """
    if not scores_list:
        raise ValueError("reduce_scores needs the scores of at least one layer")
    norm = normalize_rows if normalize else (lambda scores: scores)
    total = norm(scores_list[0].float())
    for scores in scores_list[1:]:
        total = total + norm(scores.float())
    return total


# Importing this module registers the built-in policies, unless one of them is what is importing it (a policy
# module imports this one first; `register_builtins` then runs on first use).
if not any(m in sys.modules for m in ("sparserl.kv.rkv", "sparserl.kv.snapkv", "sparserl.kv.streaming")):
    register_builtins()
