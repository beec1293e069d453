"""What the SGLang engine reads back about KV compression: per-token records and the scheduler's pool counters.

The `sparserl_kv` backend (kv_backend.py) attaches one record to every sampled token through SGLang's
`customized_info`, which SGLang accumulates in `meta_info["sparserl_kv"]`:
`[entries held in the forward that sampled it, requests running in that forward, compactions since the
previous token, the position its noise was keyed by (traced engines) or None]`, each compaction as
`[tokens generated before it, seconds, kept positions or None]`.
The scheduler's pool counters come from `get_server_info()["internal_states"][i]["sparserl_kv"]`.
No sglang import: tested in the main environment.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.engines.types import KVStats

RECORD_KEY = "sparserl_kv"  # kv_backend.RECORD_KEY (that module imports sglang)


@dataclass
class PoolCounters:
    pool_size: int
    pool_free: int
    high_water: int
    peak_running: int
    compressions: int
    compress_s: float
    query_buffer_bytes: int = 0  # the compactor's query ring (0 once the engine slept)
    host_syncs: int = -1  # device-to-host syncs of the bookkeeping (engines started with kv_count_syncs; else -1)
    decode_forwards: int = 0  # decode forwards over which host_syncs were counted


def kv_stats(records: list, prompt_len: int, n_tokens: int) -> tuple[KVStats, list]:
    """KVStats of one sequence from its first `n_tokens` records, and its compactions' kept positions
    ((layers, H_kv, keep) nested lists; empty unless the engine traces them)."""
    records = records[:n_tokens]
    if len(records) != n_tokens:
        raise RuntimeError(f"the sparserl_kv backend reported {len(records)} records for {n_tokens} tokens")
    events = [e for r in records for e in r[2]]
    held = [r[0] for r in records]
    stats = KVStats(peak_slots=max(held, default=0), retained_tokens=held[-1] if held else 0,
                    total_tokens=prompt_len + n_tokens - 1, compressions=len(events),
                    compress_s=sum(e[1] for e in events), compressed_at=[e[0] for e in events])
    return stats, [e[2] for e in events if e[2] is not None]


def pool_counters(server_info: dict) -> PoolCounters:
    states = [s.get(RECORD_KEY) for s in server_info.get("internal_states") or [] if isinstance(s, dict)]
    states = [s for s in states if s]
    if not states:
        raise RuntimeError("SGLang did not report sparserl_kv pool counters: the sparserl_kv plugin is not loaded "
                           "in its scheduler (is sparserl installed with pip install -e . ?)")
    s = states[0]
    return PoolCounters(s["pool_size"], s["pool_free"], s["high_water"], s["peak_running"], s["compressions"],
                        s["compress_s"], s.get("query_buffer_bytes", 0), s.get("host_syncs", -1),
                        s.get("decode_forwards", 0))


def drawn_positions(records: list, n_tokens: int) -> list:
    """The position each of a sequence's first `n_tokens` tokens had its noise keyed by (None where untraced)."""
    return [r[3] if len(r) > 3 else None for r in records[:n_tokens]]
