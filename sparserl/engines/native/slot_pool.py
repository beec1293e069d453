"""Bookkeeping for the KV slot pool: which slots are free, and the high-water mark.

A slot holds one token's keys and values in every layer (the tensors live in the model runner). This module
is plain Python so the scheduler can be tested without a model. Left out on purpose: paging (a slot is one
token; compression frees single tokens, which pages would make coarse) and prefix caching across requests.
"""
from __future__ import annotations


class PoolExhausted(RuntimeError):
    """Raised when more slots are requested than are free; the scheduler's admission should prevent it."""


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the KV slot pool needs at least one slot, got num_slots={num_slots}")
        self.num_slots = num_slots
        # Pop from the end: low slot ids are handed out first, which keeps early runs compact.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.high_water = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} KV slots with {len(self._free)} of {self.num_slots} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        self.high_water = max(self.high_water, self.num_used)
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
        assert len(self._free) <= self.num_slots, "a slot was freed twice"

    def reset_high_water(self) -> None:
        self.high_water = self.num_used
