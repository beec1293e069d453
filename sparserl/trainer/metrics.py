"""Step metrics that need every rank's view: rewards, lengths, KV use, throughput, memory.

Left out on purpose: per-env breakdowns of env modules (they can put their own numbers in `extra_info`);
OpenReward runs get `openreward/<env>/samples` and `reward_mean` per env, and `tool/*` counts per sample.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from sparserl.engines.protocol import EngineStats
from sparserl.rollout.episode import Sample
from sparserl.utils.memory import peak_rss_gb, rss_bytes


def gather_step_metrics(step: int, samples: list[Sample], rollout_metrics: dict, stats: EngineStats, batch, timers: dict,
                        step_s: float, dp_group, device, retractions: bool = False) -> dict[str, float]:
    """`retractions`: also `kv/retractions` and `kv/recomputed_tokens` (a run that sizes the KV pool itself)."""
    kv = [k for s in samples for k in s.kv]
    retained = sum(k.retained_tokens for k in kv)
    total = sum(k.total_tokens for k in kv)
    local = {
        # Sums over ranks; means are formed below so they weigh every sample equally.
        "n": float(len(samples)),
        "reward_sum": sum(s.reward for s in samples),
        "reward_sq": sum(s.reward**2 for s in samples),
        "len_sum": float(sum(len(s.response_ids) for s in samples)),
        "error": float(sum(s.status == "error" for s in samples)),
        "timeout": float(sum(s.status == "timeout" for s in samples)),
        "truncated": float(sum(s.status == "truncated" for s in samples)),
        "retained": float(retained),
        "total": float(total),
        "new_tokens": float(stats.new_tokens),
        "train_tokens": float(sum(len(x) for x in batch.ids)),
        "compressions": float(stats.compressions),
        "compress_s": stats.compress_s,
    }
    if retractions:
        local.update(retractions=float(stats.retractions), recomputed=float(stats.recomputed_tokens))
    maxes = {"peak_slots": float(stats.peak_slots), "peak_kv_gb": stats.peak_kv_bytes / 2**30,
             "len_max": float(max(len(s.response_ids) for s in samples)), "rollout_s": timers.get("perf/rollout_s", 0.0),
             "update_s": timers.get("perf/update_s", 0.0), "peak_running": float(stats.peak_running)}
    g = _reduce(local, dist.ReduceOp.SUM, dp_group, device)
    m = _reduce(maxes, dist.ReduceOp.MAX, dp_group, device)
    n = max(g["n"], 1.0)
    mean = g["reward_sum"] / n
    out = {
        "step": step,
        "reward/mean": mean,
        "reward/std": max(g["reward_sq"] / n - mean**2, 0.0) ** 0.5,
        "response/len_mean": g["len_sum"] / n,
        "response/len_max": m["len_max"],
        "response/truncated_frac": g["truncated"] / n,
        "env/error_frac": g["error"] / n,
        "env/error_count": g["error"],
        "env/timeout_frac": g["timeout"] / n,
        "kv/peak_slots": m["peak_slots"],
        "kv/peak_gb": m["peak_kv_gb"],
        "kv/retained_frac": g["retained"] / g["total"] if g["total"] else 1.0,
        "kv/compressions": g["compressions"],
        "kv/compress_s": g["compress_s"],
        "kv/peak_running": m["peak_running"],
        **({"kv/retractions": g["retractions"], "kv/recomputed_tokens": g["recomputed"]} if retractions else {}),
        "perf/rollout_tok_s": g["new_tokens"] / m["rollout_s"] if m["rollout_s"] else 0.0,
        "perf/train_tok_s": g["train_tokens"] / m["update_s"] if m["update_s"] else 0.0,
        "perf/step_s": step_s,
    }
    # Per-sample means of the rollout (tool-call counts of tool envs included) weigh every sample equally.
    means = sorted(k for k in rollout_metrics if k in ("score/mean", "env/turns_mean") or k.startswith("tool/"))
    if means:
        sums = _reduce({k: rollout_metrics[k] * len(samples) for k in means}, dist.ReduceOp.SUM, dp_group, device)
        out.update({k: float(v / n) for k, v in sums.items()})
    out.update(_per_env(rollout_metrics, dp_group, device))
    if stats.extra:  # the engine's own `rollout/*` numbers (weight bytes, the re-scored KV share): mean over ranks
        dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        out.update({k: v / dp for k, v in _reduce(dict(stats.extra), dist.ReduceOp.SUM, dp_group, device).items()})
    out.update(timers)
    return out


def _per_env(rollout_metrics: dict, dp_group, device) -> dict[str, float]:
    """`openreward/<env>/samples` and `openreward/<env>/reward_mean` from every rank's counts and reward sums
    (every rank reports every env of the run, so the keys agree)."""
    sums = {k: v for k, v in rollout_metrics.items() if k.startswith("openreward/") and k.endswith(("/count", "/reward_sum"))}
    if not sums:
        return {}
    g = _reduce(sums, dist.ReduceOp.SUM, dp_group, device)
    out = {}
    for key in (k for k in g if k.endswith("/count")):
        env = key[: -len("/count")]
        out[f"{env}/samples"] = g[key]
        out[f"{env}/reward_mean"] = g[f"{env}/reward_sum"] / g[key] if g[key] else 0.0
    return out


def _reduce(values: dict[str, float], op, group, device) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.tolist()))


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


def memory_metrics(device: torch.device, group) -> dict[str, float]:
    """This rank's peak and current memory (`mem/peak_gb`, `mem/rss_gb`) and the largest peak of any DP rank."""
    peak = peak_memory_gb(device)
    top = torch.tensor([peak], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return {"mem/peak_gb": peak, "mem/peak_gb_max_rank": float(top), "mem/rss_gb": rss_bytes() / 2**30}
