"""The state of one sequence inside the native engine (plain Python, no tensors)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable

from sparserl.engines.types import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_index: int
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    reserve: int  # worst-case slots this sequence can ever hold (admission=reserve holds them for it)
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # cache entries it holds, in cache order (all layers alike)
    slots_version: int = 0  # bumped when `slots` is rewritten (compaction), not when it grows
    num_cached: int = 0  # logical tokens whose K/V went through the cache (compression does not lower it)
    fork_of: "Sequence | None" = None  # sibling whose prefill this one copies instead of recomputing
    finish_reason: str | None = None
    peak_slots: int = 0
    retained_at_finish: int = 0  # slots held when it finished
    compressions: int = 0
    compress_s: float = 0.0
    compressed_at: list[int] = field(default_factory=list)  # len(output) at each compression
    admitted_step: int = -1
    seed_index: int | None = None  # keys the sampling stream in place of request_index (GenerationRequest.seed_index)
    # Engine sessions: the key this sequence's KV is held under when it finishes (None: released), and what
    # it continues. A continued sequence starts with the session's `slots` and `num_cached = reused`, so only
    # prompt[reused:] is prefilled; `carry` is the compressor's state for the held cache (None when dense).
    session: Hashable | None = None
    keep: bool = False
    reused: int = 0
    carry: Any = None
    # Optimistic admission (scheduler.py): a retracted sequence gave its slots back and prefills prompt + output
    # again. `replay_ends`: the logical lengths at which that re-prefill stops to compact the cache as it was
    # compacted the first time (one per entry of `compressed_at`), so the rebuilt cache is the one that drew the
    # tokens; empty for a dense cache. `retractable` is False where re-prefill cannot rebuild the cache (a
    # compressed continuation of a held session: the earlier turns' compaction is not replayed); such a sequence is
    # admitted on its worst case and never retracted.
    replay_ends: list[int] = field(default_factory=list)
    retractable: bool = True
    retractions: int = 0
    recomputed: int = 0  # tokens whose K/V a retraction threw away and a re-prefill computed again
    resumed: int = 0  # leading output tokens a resumed request brought (partial.py), drawn by an earlier call
    kv: Any = None  # the KVPolicyConfig it compresses under (None: dense); a resumed one keeps its budget (partial.py)
    # Per-request generator state lives in the sampler, keyed by seq_id.

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending_end(self) -> int:
        """Where the tokens of the next forward end: the next replay stop of a resumed sequence, else all tokens."""
        return self.replay_ends[0] if self.replay_ends else len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        return self.pending_end - self.num_cached

    @property
    def decoding(self) -> bool:
        """Only the last sample is pending: the sequence runs as one decode row."""
        return self.num_cached > 0 and self.num_cached == len(self.prompt) + len(self.output) - 1

    @property
    def pending(self) -> list[int]:
        """Tokens that must go through the model before the next sample: the prompt (prefill), the last sample, or
        a resumed sequence's next stretch of prompt + output."""
        p, end = len(self.prompt), self.pending_end
        if self.num_cached >= p:  # decoding: only output tokens are pending (no copy of the whole history)
            return self.output[self.num_cached - p : end - p]
        return (self.prompt + self.output)[self.num_cached : end]

    @property
    def next_position(self) -> int:
        return self.num_cached
