"""From this rank's rollout samples to the padded `TrainBatch` of one update.

Per-token lists (loss mask, sampler log-probs) become response-aligned (B, T) float32 tensors, zero-padded to
the longest response. The batch starts with the sampler's log-probs only: advantages zero, no logp_old, no
correction weights; the trainer's later steps fill them in (trainer/old_logprobs.py, trainer/advantages.py).

Left out on purpose: truncating long responses (the rollout's length limits already bound them) and any other
padding value than 0 (the mask decides which positions count).
"""
from __future__ import annotations

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.rollout.episode import Sample


def pad(rows: list[list[float]], T: int, device) -> torch.Tensor:
    """(len(rows), T) float32, each row's values first, zeros after."""
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def to_train_batch(samples: list[Sample], device) -> TrainBatch:
    """The batch with the sampler's log-probs; advantages unset, no dense log-probs yet."""
    T = max(1, max(len(s.response_ids) for s in samples))
    return TrainBatch(
        ids=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        mask=pad([s.loss_mask for s in samples], T, device),
        advantages=torch.zeros(len(samples), device=device),
        logp_sparse=pad([s.logp_sparse for s in samples], T, device),
    )
