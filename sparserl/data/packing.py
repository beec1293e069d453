"""Spread sequences over data-parallel ranks with balanced token loads, and cut each rank's share into
micro-batches of at most `max_tokens` packed tokens.

- `balanced_partition`: Karmarkar-Karp largest differencing for a k-way partition of the token counts. Every
  rank waits for the slowest at each FSDP collective, so the step time follows the heaviest rank; LDM gets
  far closer to the mean than greedy or round-robin splits on long-tailed RL response lengths.
- `split_microbatches`: first-fit decreasing. Sequences sorted by length, each placed into the first
  micro-batch with room, so micro-batches are few and full (no padding: they are packed into one row). A
  sequence longer than the bound gets a micro-batch of its own rather than being truncated.
- `plan_microbatches` composes the two; `flatten_plan` + `inverse_permutation` put per-sequence results
  computed in plan order back into the original order.
- `prompt_units` + `split_shared_microbatches`: with shared prompts (`actor.share_prompts`) the GRPO samples of
  one prompt are packed as the prompt once followed by every response (actor/logprobs.py), so the unit of
  packing is a prompt's group and its cost the prompt plus the responses; groups too large for one micro-batch
  (or for a fair share of the DP ranks) are cut into pieces that each carry their own copy of the prompt.

Left out on purpose: balancing by attention cost (quadratic in length) rather than by token count, and equal
sequence counts per rank (the loss uses globally all-reduced normalizers, so uneven counts are fine).
"""
from __future__ import annotations

import heapq


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


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split indices of `lengths` into `k` lists with near-equal length sums (each list sorted; some may be
    empty when there are fewer than k items).

    Largest differencing: every item starts as a k-way partial partition ({item}, {}, ..., {}). Repeatedly
    take the two partial partitions whose largest and smallest sums differ most and merge them, pairing the
    heaviest subset of one with the lightest of the other, which cancels their spreads against each other.
    """
    if k <= 0:
        raise ValueError(f"balanced_partition: k must be positive, got {k}")
    # Heap entries: (-spread, tie-break, subsets); subsets = [(sum, indices)] sorted by sum, heaviest first.
    heap = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        subsets = [(lengths[i], [i])] + [(0, []) for _ in range(k - 1)]
        heap.append((-lengths[i], i, subsets))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(idx) for _, idx in heap[0][2]]


def plan_microbatches(lengths: list[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """plan[rank][micro-batch] = global sequence indices: balanced over ranks, then packed per rank."""
    plan = []
    for share in balanced_partition(lengths, dp_size):
        mbs = split_microbatches([lengths[i] for i in share], max_tokens) if share else []
        plan.append([[share[j] for j in mb] for mb in mbs])
    return plan


def contiguous_minibatches(n: int, k: int) -> list[list[int]]:
    """The k contiguous slices of range(n): one rank's share of each optimizer step's sequences."""
    return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]


def flatten_plan(plan: list[list[list[int]]]) -> list[int]:
    """The global indices in plan order: rank by rank, micro-batch by micro-batch."""
    return [i for rank in plan for mb in rank for i in mb]


def inverse_permutation(order: list[int]) -> list[int]:
    """inv with inv[order[p]] = p, so `[results[p] for p in inv]` puts results listed in `order` back in index order."""
    inv = [-1] * len(order)
    for pos, i in enumerate(order):
        if not 0 <= i < len(order) or inv[i] != -1:
            raise ValueError(f"not a permutation of 0..{len(order) - 1}: index {i} at position {pos}")
        inv[i] = pos
    return inv


def prompt_units(keys: list, prompt_lens: list[int], lengths: list[int], max_cost: int) -> list[tuple[list[int], int]]:
    """Groups of indices with the same prompt `keys[i]`, cut into pieces of cost <= `max_cost` (or one sequence).

    Cost of a piece = its prompt length once + the response lengths (`lengths[i] - prompt_lens[i]`): the tokens
    a shared-prompt forward computes. Indices in a piece keep their order; pieces come in order of first index.
    """
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    units = []
    for members in groups.values():
        p = prompt_lens[members[0]]
        piece, cost = [], p
        for i in members:
            r = lengths[i] - prompt_lens[i]
            if piece and cost + r > max_cost:
                units.append((piece, cost))
                piece, cost = [], p
            piece.append(i)
            cost += r
        units.append((piece, cost))
    return units


def split_shared_microbatches(keys: list, prompt_lens: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """`split_microbatches` over prompt groups: first-fit decreasing of `prompt_units` by cost, so a prompt's
    samples land in the same micro-batch and its prompt is computed once there. Each list sorted."""
    if max_tokens <= 0:
        raise ValueError(f"actor.max_tokens_per_device must be positive, got {max_tokens}")
    units = prompt_units(keys, prompt_lens, lengths, max_tokens)
    bins = split_microbatches([cost for _, cost in units], max_tokens)
    return [sorted(i for u in b for i in units[u][0]) for b in bins]
