"""Push the actor's weights into a rollout engine: full tensors, gathered from shards, in buckets.

Every rank joins the gather of every tensor (a collective), and a bucket of about `bucket_mb` is handed over at
a time so peak extra memory stays bounded. An engine may say two things, read with defaults so any engine
works as it is:
  - `weight_dtype` (default None): the dtype it casts the tensors to on load. The actor's shards are cast
    before the gather (`Actor.full_state().gather`), so a bf16 engine costs half the bytes of an fp32 actor
    on the wire and in host memory, and the values are the same as casting afterwards.
  - `receives_weights` (default True): False on a rank whose engine lives in another process (an SGLang
    tensor-parallel peer); that rank joins the gathers, drops each tensor at once and hands nothing over.
`perf/weight_sync_gb` counts the bytes handed to this rank's engine.
A LoRA actor (actor.lora.rank > 0) needs nothing here: its `full_state()` walk yields base + adapter merged under
the original parameter names (actor/lora.py `merged_state`), so both engines load plain weights.
Left out on purpose: CUDA-IPC handles and NCCL broadcast to remote engines (engines here live in the
training processes), and gathering to the owner only (DTensor gathers to every rank of the mesh).
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
    """Hand `named` (full tensors, or the actor's `full_state()`, gathered here as the engine asks) to `engine`."""
    t0 = time.perf_counter()
    receives = bool(getattr(engine, "receives_weights", True))
    gather = getattr(named, "gather", None)
    if gather is not None:
        named = gather(dtype=getattr(engine, "weight_dtype", None), keep=receives)
    n = 0
    if not receives:
        for _ in named:  # the gathers are collectives: run every one, keep nothing
            pass
        return {"perf/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_gb": 0.0}
    for bucket in buckets(named, bucket_mb):
        engine.update_weights(bucket)
        n += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"perf/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_gb": n / 2**30}
