"""KV-cache compression policies: pure tensor functions deciding which cached tokens a request keeps.

Importing the package registers the built-in policies (rkv, snapkv, streaming) in `POLICIES`.
Left out on purpose: any engine, pool or slot logic; the engines gather and free what these functions pick.
"""
from sparserl.kv.base import (
    POLICIES,
    REFERENCE_POLICIES,
    VARIANTS,
    KVPolicyConfig,
    reduce_scores,
    register_policy,
    score_tokens,
    select_keep,
)
from sparserl.kv import rkv, snapkv, streaming  # noqa: F401  (registers the built-in policies)
from sparserl.kv.schedule import CompressionSchedule, NewlineTokens, is_newline_token

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
