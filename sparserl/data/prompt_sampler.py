"""Which prompts each training step uses, and which of them this DP rank rolls out.

Every rank builds the same `PromptSampler` (same seed) and so computes the same global batch without
communication; it keeps its contiguous share. Each epoch is one permutation of all rows, drawn from
(seed, epoch); a step that runs past the end of an epoch takes the rest from the next epoch's
permutation, so every row is used once per epoch and no row is dropped. The state is (epoch, offset,
step), independent of the DP size, so a run can resume on a different number of ranks.

Left out on purpose: length-grouped or curriculum ordering, and filtering (the trainer decides what to
do with uninformative groups).
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
    global_indices: list[int]  # prompts_per_step row indices, the same on every rank
    local_indices: list[int]  # this rank's contiguous share of global_indices


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
        share = self.prompts_per_step // self.dp_size
        local = picked[self.dp_rank * share : (self.dp_rank + 1) * share]
        batch = StepBatch(step=self.step, epoch=first_epoch, global_indices=picked, local_indices=local)
        self.step += 1
        return batch

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

    def quotas(self) -> list[int]:
        total = sum(self.weights)
        pps = self.outer.prompts_per_step
        want = [c + pps * w / total for c, w in zip(self.carry, self.weights)]
        quota = [math.floor(x + 1e-9) for x in want]
        for i in sorted(range(len(want)), key=lambda i: (-(want[i] - quota[i]), i))[: pps - sum(quota)]:
            quota[i] += 1
        self.carry = [x - q for x, q in zip(want, quota)]
        return quota

    def next(self) -> StepBatch:
        picked = [self.offsets[i] + r for i, q in enumerate(self.quotas()) for r in self.sources[i].take(q)]
        if self.outer.shuffle:
            picked = [picked[j] for j in np.random.default_rng([self.outer.seed, self.step, 1]).permutation(len(picked))]
        share = self.outer.prompts_per_step // self.outer.dp_size
        local = picked[self.outer.dp_rank * share : (self.outer.dp_rank + 1) * share]
        batch = StepBatch(step=self.step, epoch=self.sources[0].epoch, global_indices=picked, local_indices=local)
        self.step += 1
        return batch

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
