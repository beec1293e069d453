"""`balance_ranks`: moves sequences between DP ranks before the update so every rank trains on a near-equal
number of tokens.

Rollouts are colocated, so each rank starts with the sequences its own engine sampled, and their token counts
differ (long-tailed response lengths). Every FSDP collective waits for the slowest rank, so the update time
follows the heaviest one. Each rank describes its sequences as `SeqRecord`s (everything the update reads about
one sequence), every rank gathers every record, and each computes the same split (data/packing.py
`balanced_partition`, deterministic) and keeps its own part.

With `token_weights=(trained, no_grad)` a token of a sequence the actor trains costs `trained` and one of a
zero-advantage group it only runs forward (`actor.skip_zero_advantage`) costs `no_grad`: the trainer passes (4, 1)
with activation checkpointing (forward, recomputed forward and a backward of two forwards' work) and (3, 1)
without, so the ranks' update times, not their token counts, come out equal.

Left out on purpose: moving sequences across optimizer steps (each step keeps the sequence set it would have
without balancing, so the update is unchanged) and balancing by attention cost rather than token count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.actor.logprobs import prompt_key
from sparserl.data.packing import balanced_partition, contiguous_minibatches, prompt_units

# The batch's per-token (B, T) fields that travel with a sequence (those that are set).
PER_TOKEN = ("mask", "logp_old", "logp_sparse", "logp_ref", "weights", "kl_weights", "response_mask", "values",
             "returns", "fresh_mask")


@dataclass
class SeqRecord:
    """One sequence as it moves between ranks: what the update reads about it, and where it came from."""

    minibatch: int  # the optimizer step it belongs to (the home rank's contiguous slice it was in)
    ids: list[int]  # prompt + response tokens
    prompt_len: int
    advantage: float | torch.Tensor  # its advantage, or its per-token advantages (response length, on CPU)
    per_token: dict[str, torch.Tensor]  # the batch's per-token rows (PER_TOKEN), cut to the response length, on CPU
    origin: tuple[int, int]  # (DP rank, row) it was rolled out at

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def balance_ranks(batch: TrainBatch, num_minibatches: int, dp_group, share_prompts: bool = False,
                  token_weights: tuple[int, int] = (1, 1)) -> tuple[TrainBatch, list[list[int]], dict]:
    """Moves sequences between DP ranks so that every rank trains on a near-equal number of tokens.

    Each global minibatch (the union of every rank's k-th contiguous slice, which is what `Actor.update` would
    train on at optimizer step k) is split over the ranks by Karmarkar-Karp on token counts. The optimizer steps
    therefore see the same sequence sets as without balancing, and since losses are normalized by all-reduced
    counts, the update is the same up to the order of floating-point sums. Returns this rank's new batch, its
    minibatches (local indices, one list per optimizer step) and metrics (max/mean token load over ranks, before
    and after). Each row of the new batch keeps its `origin`, the (DP rank, row) it was rolled out at, so logged
    samples can find it (trainer/samples.py).
    With `share_prompts` (`actor.share_prompts`) the units moved are a prompt's samples, in pieces of at most half
    a rank's fair share, costed as the tokens a shared-prompt forward computes (prompt once + responses), so a
    prompt's samples stay together and share its forward (actor/logprobs.py).
    """
    world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    home = contiguous_minibatches(len(batch), num_minibatches)
    if world == 1:
        return batch, home, {}
    rank = dist.get_rank(dp_group)
    fields = [f for f in PER_TOKEN if getattr(batch, f) is not None]
    everyone: list[list[SeqRecord]] = [None] * world
    dist.all_gather_object(everyone, _records(batch, home, fields, rank), group=dp_group)
    before = [_load(part, share_prompts, token_weights) for part in everyone]
    rows: list[SeqRecord] = []
    minibatches, after = [], [0] * world
    for k in range(num_minibatches):
        pool = [seq for part in everyone for seq in part if seq.minibatch == k]  # same order on every rank
        units = _units(pool, world, share_prompts, token_weights)
        costs = [cost for _, cost in units]
        unit_parts = balanced_partition(costs, world)  # deterministic: every rank computes the same split
        parts = [sorted(j for u in share for j in units[u][0]) for share in unit_parts]
        loads = [sum(costs[u] for u in share) for share in unit_parts]
        if share_prompts:  # where the split is no better than what the ranks rolled out (whole groups each), keep that
            parts, loads = _keep_home_if_no_worse(everyone, pool, k, parts, loads, token_weights)
        for r in range(world):
            after[r] += loads[r]
        minibatches.append(list(range(len(rows), len(rows) + len(parts[rank]))))
        rows.extend(pool[j] for j in parts[rank])
    new = _to_batch(rows, {f: getattr(batch, f).dtype for f in fields}, batch.mask.device, batch.advantages.dim() == 2)
    mean = max(sum(before) / world, 1e-9)
    metrics = {"perf/dp_load_imbalance_before": max(before) / mean, "perf/dp_load_imbalance": max(after) / mean}
    return new, minibatches, metrics


def _records(batch: TrainBatch, home: list[list[int]], fields: list[str], rank: int) -> list[SeqRecord]:
    """This rank's sequences, minibatch by minibatch."""
    out = []
    for k, index in enumerate(home):
        for i in index:
            r = len(batch.ids[i]) - batch.prompt_lens[i]
            out.append(SeqRecord(
                minibatch=k, ids=batch.ids[i], prompt_len=batch.prompt_lens[i],
                advantage=batch.advantages[i, :r].detach().cpu() if batch.advantages.dim() == 2
                else float(batch.advantages[i]),
                per_token={f: getattr(batch, f)[i, :r].detach().cpu() for f in fields},
                origin=batch.origin[i] if batch.origin is not None else (rank, i)))
    return out


def _to_batch(rows: list[SeqRecord], dtypes: dict[str, torch.dtype], device, per_token_adv: bool = False) -> TrainBatch:
    """The TrainBatch of `rows`, in order: per-token fields (and per-token advantages) zero-padded to the longest
    response."""
    T = max([1] + [seq.response_len for seq in rows])

    def padded(values: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(len(rows), T, dtype=dtype)
        for i, v in enumerate(values):
            t[i, : len(v)] = v
        return t.to(device)

    per_token = {f: padded([seq.per_token[f] for seq in rows], dtype) for f, dtype in dtypes.items()}
    if per_token_adv:
        advantages = padded([seq.advantage for seq in rows], torch.float32)
    else:
        advantages = torch.tensor([seq.advantage for seq in rows], dtype=torch.float32, device=device)
    return TrainBatch(ids=[seq.ids for seq in rows], prompt_lens=[seq.prompt_len for seq in rows],
                      advantages=advantages, origin=[seq.origin for seq in rows], **per_token)


def _units(pool: list[SeqRecord], world: int, share_prompts: bool,
           token_weights: tuple[int, int] = (1, 1)) -> list[tuple[list[int], int]]:
    """(indices into `pool`, cost) of what `balance_ranks` moves: single sequences, or prompt groups; the cost is
    their tokens times `token_weights[0]`, or `token_weights[1]` for a unit whose advantages are all 0."""
    lengths = [len(seq.ids) for seq in pool]
    if not share_prompts:
        units = [([j], n) for j, n in enumerate(lengths)]
    else:
        prompt_lens = [seq.prompt_len for seq in pool]
        keys = [prompt_key(seq.ids, seq.prompt_len) for seq in pool]
        total = sum(lengths) - sum(prompt_lens) + sum({key: p for key, p in zip(keys, prompt_lens)}.values())  # prompts once
        units = prompt_units(keys, prompt_lens, lengths, max(1, total // (2 * world)))
    trained, no_grad = token_weights
    return [(idx, cost * (trained if any(_nonzero(pool[j].advantage) for j in idx) else no_grad)) for idx, cost in units]


def _nonzero(advantage: float | torch.Tensor) -> bool:
    return bool(advantage.any()) if isinstance(advantage, torch.Tensor) else advantage != 0


def _load(records: list[SeqRecord], share_prompts: bool, token_weights: tuple[int, int] = (1, 1)) -> int:
    """The cost of `records` on one rank: tokens (prompts once per group with `share_prompts`) times their weight."""
    return sum(cost for _, cost in _units(records, 1, share_prompts, token_weights))


def _keep_home_if_no_worse(everyone: list[list[SeqRecord]], pool: list[SeqRecord], k: int, parts: list[list[int]],
                           loads: list[int], token_weights: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    """`parts` / `loads`, or each rank's own minibatch-k sequences where that split is no more uneven."""
    home_parts, start = [], 0
    for part in everyone:
        size = sum(seq.minibatch == k for seq in part)
        home_parts.append(list(range(start, start + size)))
        start += size
    home_loads = [_load([pool[j] for j in hp], True, token_weights) for hp in home_parts]
    return (home_parts, home_loads) if max(home_loads) <= max(loads) else (parts, loads)
