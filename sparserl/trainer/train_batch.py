"""From this rank's rollout samples to the padded `TrainBatch` of one update.

Per-token lists (loss mask, sampler log-probs) become response-aligned (B, T) float32 tensors, zero-padded to
the longest response. The batch starts with the sampler's log-probs only: advantages zero, no logp_old (unless
dynamic sampling already computed it, trainer/dynamic_sampling.py), no correction weights; the trainer's later
steps fill them in (trainer/loss_path.py, trainer/advantages.py).

With `algo.overlong.mask` a sample whose last model turn was cut by a length limit (`episode.cut_by_length`)
starts with an all-zero loss mask: it stays in the batch (and in its group's baseline) but leaves the loss and
its token count. In a multi-turn episode only the last turn can be cut (a cut turn ends the episode), and the
whole episode leaves the loss.

Left out on purpose: truncating long responses (the rollout's length limits already bound them) and any other
padding value than 0 (the mask decides which positions count).
"""
from __future__ import annotations

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.algo.overlong import mask_truncated
from sparserl.rollout.episode import Sample, cut_by_length


def pad(rows: list[list[float]], T: int, device) -> torch.Tensor:
    """(len(rows), T) float32, each row's values first, zeros after."""
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def pad_rows(rows: list[torch.Tensor], T: int, device) -> torch.Tensor:
    """(len(rows), T) in the rows' dtype, each 1-D row first, zeros after."""
    out = torch.zeros(len(rows), T, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out.to(device)


def to_train_batch(samples: list[Sample], device, mask_overlong: bool = False,
                   logp_old: list[torch.Tensor] | None = None) -> TrainBatch:
    """The batch with the sampler's log-probs; advantages unset. `mask_overlong`: `algo.overlong.mask` (see the
    module docstring). `logp_old`: each sample's dense log-probs (response length) where they are known already."""
    T = max([1] + [len(s.response_ids) for s in samples])
    response_mask = mask = pad([s.loss_mask for s in samples], T, device)
    if mask_overlong:
        mask = mask_truncated(mask, torch.tensor([cut_by_length(s) for s in samples], dtype=torch.bool, device=device))
    return TrainBatch(
        ids=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        mask=mask,
        response_mask=response_mask,
        advantages=torch.zeros(len(samples), device=device),
        logp_sparse=pad([s.logp_sparse for s in samples], T, device),
        logp_old=None if logp_old is None else pad_rows(logp_old, T, device),
    )
