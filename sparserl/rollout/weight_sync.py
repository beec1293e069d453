"""Push the actor's weights into a rollout engine: full tensors, gathered from shards, in buckets.

Every rank gathers every tensor (the gather is a collective) and loads it into its own engine; a bucket of
about `bucket_mb` is handed over at a time so peak extra memory stays bounded. Left out on purpose:
CUDA-IPC handles and NCCL broadcast to remote engines (engines here live in the training processes).
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256) -> Iterator[list[tuple[str, torch.Tensor]]]:
    limit = bucket_mb * 2**20
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size >= limit:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def sync_weights(named: Iterable[tuple[str, torch.Tensor]], engine, bucket_mb: float = 256) -> dict[str, float]:
    t0 = time.perf_counter()
    n = 0
    for bucket in buckets(named, bucket_mb):
        engine.update_weights(bucket)
        n += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"perf/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_gb": n / 2**30}
