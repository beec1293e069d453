"""KV-cache compression policies: pure tensor functions deciding which cached tokens a request keeps.

`KVPolicyConfig` (sparserl/kv/policy.py) imports no torch, so `from sparserl.kv import KVPolicyConfig` and the
run's config stay light; every other name loads the tensor code (sparserl/kv/base.py, which registers the
built-in policies rkv, snapkv and streaming in `POLICIES`) on first use.
sparserl/kv/compaction.py (imported by name, not re-exported) holds the one KV compaction both engines adapt:
query ring, per-request state, selection over every layer, per-head moves on a (slots, H_kv, D) pool.
Left out on purpose: any engine, slot allocation or freeing; the engines supply slots and free what compaction
leaves behind.
"""
from __future__ import annotations

import importlib
from typing import Any

from sparserl.kv.policy import VARIANTS, KVPolicyConfig

_LAZY = {
    "POLICIES": "sparserl.kv.base",
    "REFERENCE_POLICIES": "sparserl.kv.base",
    "reduce_scores": "sparserl.kv.base",
    "register_policy": "sparserl.kv.base",
    "score_tokens": "sparserl.kv.base",
    "select_keep": "sparserl.kv.base",
    "CompressionSchedule": "sparserl.kv.schedule",
    "NewlineTokens": "sparserl.kv.schedule",
    "is_newline_token": "sparserl.kv.schedule",
}

__all__ = [
    "POLICIES",
    "REFERENCE_POLICIES",
    "VARIANTS",
    "CompressionSchedule",
    "KVPolicyConfig",
    "is_newline_token",
    "NewlineTokens",
    "reduce_scores",
    "register_policy",
    "score_tokens",
    "select_keep",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("sparserl.kv.base").register_builtins()
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
