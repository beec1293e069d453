"""Cut a rank's sequences into micro-batches of at most `max_tokens` packed tokens.

First-fit decreasing: sequences sorted by length, each placed into the first micro-batch with room, so
micro-batches are few and full (no padding: they are packed into one row). A sequence longer than the
bound gets a micro-batch of its own rather than being truncated. Left out on purpose: balancing across
DP ranks (every rank packs its own samples; ranks only agree on the micro-batch count).
"""
from __future__ import annotations


def split_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Returns lists of sequence indices; every index appears exactly once; each list sorted."""
    if max_tokens <= 0:
        raise ValueError(f"actor.max_tokens_per_device must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]
