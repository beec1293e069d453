"""Which prompts each training step uses, and which of them this DP rank rolls out.

Every rank builds the same `PromptSampler` (same seed) and so computes the same global batch without
communication; it keeps its contiguous share. Each epoch is one permutation of all rows, drawn from
(seed, epoch); a step that runs past the end of an epoch takes the rest from the next epoch's
permutation, so every row is used once per epoch and no row is dropped. The state is (epoch, offset,
step), independent of the DP size, so a run can resume on a different number of ranks.

`more(count, round)` draws the extra prompts of a dynamic-sampling round (trainer/dynamic_sampling.py) from the
same stream, without starting a new step: the state then counts them, so a resumed run draws what the
uninterrupted one would. An extra round's size need not divide by the DP size: its prompts are split
contiguously, the first ranks taking one more where it does not (`split`).

Left out on purpose: length-grouped or curriculum ordering, and filtering (the trainer decides what to
do with uninformative groups: trainer/dynamic_sampling.py), and giving back prompts drawn but not trained on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sparserl.utils.seed import derive


@dataclass(frozen=True)
class StepBatch:
    step: int
    epoch: int  # epoch of the first prompt in the batch
    global_indices: list[int]  # prompts_per_step row indices (or a dynamic-sampling round's), the same on every rank
    local_indices: list[int]  # this rank's contiguous share of global_indices
    local_start: int = 0  # where that share starts in global_indices (a prompt's seed index is its place there)


def split(count: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, end) of rank `dp_rank`'s contiguous share of `count` items; shares differ by at most one item."""
    return dp_rank * count // dp_size, (dp_rank + 1) * count // dp_size


def _step_batch(step: int, epoch: int, picked: list[int], dp_rank: int, dp_size: int) -> StepBatch:
    start, end = split(len(picked), dp_rank, dp_size)
    return StepBatch(step=step, epoch=epoch, global_indices=picked, local_indices=picked[start:end], local_start=start)


class PromptSampler:
    def __init__(self, num_rows: int, prompts_per_step: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        if num_rows <= 0:
            raise ValueError(f"the prompt set is empty (num_rows={num_rows})")
        if prompts_per_step <= 0:
            raise ValueError(f"trainer.prompts_per_step must be positive, got {prompts_per_step}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if prompts_per_step % dp_size:
            raise ValueError(
                f"trainer.prompts_per_step={prompts_per_step} must be divisible by the data-parallel size {dp_size} "
                f"so that every rank rolls out the same number of prompts"
            )
        self.num_rows, self.prompts_per_step = num_rows, prompts_per_step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.offset, self.step = 0, 0, 0
        self._perm_epoch, self._perm = -1, np.arange(0)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm_epoch = epoch
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                self._perm = np.arange(self.num_rows)
        return self._perm

    def take(self, count: int) -> list[int]:
        """The next `count` rows in epoch order (crossing into the next epoch where needed)."""
        picked: list[int] = []
        while len(picked) < count:
            order = self._order(self.epoch)
            take = min(count - len(picked), self.num_rows - self.offset)
            picked += order[self.offset : self.offset + take].tolist()
            self.offset += take
            if self.offset == self.num_rows:
                self.epoch, self.offset = self.epoch + 1, 0
        return picked

    def next(self) -> StepBatch:
        first_epoch = self.epoch
        picked = self.take(self.prompts_per_step)
        batch = _step_batch(self.step, first_epoch, picked, self.dp_rank, self.dp_size)
        self.step += 1
        return batch

    def more(self, count: int, round_: int) -> StepBatch:
        """`count` more prompts for round `round_` (2, 3, ...) of the step `next()` last started."""
        first_epoch = self.epoch
        return _step_batch(self.step - 1, first_epoch, self.take(count), self.dp_rank, self.dp_size)

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "step": self.step, "seed": self.seed, "num_rows": self.num_rows, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("num_rows", self.num_rows), ("seed", self.seed), ("shuffle", int(self.shuffle))):
            if key in state and state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]} but this run has {key}={mine}; resuming would reorder the data")
        if not 0 <= state["offset"] < self.num_rows:
            raise ValueError(f"sampler state offset={state['offset']} is outside [0, {self.num_rows})")
        self.epoch, self.offset, self.step = int(state["epoch"]), int(state["offset"]), int(state["step"])


class MixtureSampler:
    """Each step's prompts drawn from several sources (the envs of a run) in proportion to their weights.

    The rows are grouped by source: source i holds `sizes[i]` consecutive rows. A step takes `quota_i` rows
    from source i, where the quotas sum to `prompts_per_step` and follow the weights through carried
    remainders (largest remainder first): over steps each source's share converges to weight_i / sum(weights)
    exactly, and a source with a small weight still shows up every few steps. Within a source, rows follow
    its own seeded epoch permutations (as `PromptSampler`). The batch is shuffled (seeded by the step) before
    the DP split, so every rank gets a mix. Same interface and resume rules as `PromptSampler`.
    """

    def __init__(self, sizes: list[int], weights: list[float], prompts_per_step: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if len(sizes) != len(weights) or not sizes or min(sizes) <= 0 or min(weights) <= 0:
            raise ValueError(f"every source needs rows and a positive weight (sizes={sizes}, weights={weights})")
        self.outer = PromptSampler(sum(sizes), prompts_per_step, dp_rank, dp_size, seed, shuffle)  # checks the split
        self.sizes, self.weights = list(sizes), [float(w) for w in weights]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sources = [PromptSampler(n, 1, 0, 1, derive(seed, (i, 1)), shuffle) for i, n in enumerate(sizes)]
        self.carry = [0.0] * len(sizes)
        self.step = 0

    def quotas(self, count: int | None = None) -> list[int]:
        """Rows per source for the next `count` prompts (default: a step's); the remainders carry over."""
        total = sum(self.weights)
        pps = self.outer.prompts_per_step if count is None else count
        want = [c + pps * w / total for c, w in zip(self.carry, self.weights)]
        quota = [math.floor(x + 1e-9) for x in want]
        for i in sorted(range(len(want)), key=lambda i: (-(want[i] - quota[i]), i))[: pps - sum(quota)]:
            quota[i] += 1
        self.carry = [x - q for x, q in zip(want, quota)]
        return quota

    def _draw(self, count: int | None, shuffle_key: list[int]) -> StepBatch:
        picked = [self.offsets[i] + r for i, q in enumerate(self.quotas(count)) for r in self.sources[i].take(q)]
        if self.outer.shuffle:
            picked = [picked[j] for j in np.random.default_rng([self.outer.seed, *shuffle_key]).permutation(len(picked))]
        return _step_batch(self.step, self.sources[0].epoch, picked, self.outer.dp_rank, self.outer.dp_size)

    def next(self) -> StepBatch:
        batch = self._draw(None, [self.step, 1])
        self.step += 1
        return batch

    def more(self, count: int, round_: int) -> StepBatch:
        """`count` more prompts for round `round_` (2, 3, ...) of the step `next()` last started."""
        self.step -= 1  # the round belongs to that step
        try:
            return self._draw(count, [self.step, 1, round_])
        finally:
            self.step += 1

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"step": self.step, "carry": list(self.carry), "sizes": list(self.sizes), "weights": list(self.weights),
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("sizes", self.sizes), ("weights", self.weights)):
            if list(state.get(key, mine)) != mine:
                raise ValueError(f"sampler state has {key}={state[key]} but this run has {key}={mine}; resuming would change the mix")
        for source, s in zip(self.sources, state["sources"]):
            source.load_state_dict(s)
        self.carry, self.step = [float(c) for c in state["carry"]], int(state["step"])
