"""Continuous batching: decide, each step, which sequences run and where their new tokens go.

Every step decodes one token for each running sequence and, in the same forward, prefills newly admitted
ones. A sequence is admitted while the pool can honour its worst-case need (`Sequence.reserve`: prompt +
max_new_tokens dense, or the compression bound), so a running sequence never waits for a slot and nothing
is preempted. Siblings of one prompt (`n` samples) are admitted together and copy the first one's prefill.

Engine sessions (multi-turn) add `held`: slots owned outside any running reservation, by idle sessions and by
waiting sequences that continue one. Admission counts them like reservations; when they are what stands in
the way, `make_room` (the engine's eviction policy) may drop sessions to free them.

Left out on purpose: preemption by recompute (reservation makes it unnecessary), chunked prefill of one
prompt over several steps, priorities. Plain Python: testable without a model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from sparserl.engines.native.sequence import Sequence, Status
from sparserl.engines.native.slot_pool import SlotPool


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    prefill: list[Sequence] = field(default_factory=list)  # all pending tokens each
    forks: list[Sequence] = field(default_factory=list)  # copy their `fork_of`'s prefill after the forward

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(s.num_pending for s in self.prefill)

    def __len__(self) -> int:
        return len(self.decode) + len(self.prefill) + len(self.forks)


# make_room(head, shortfall, waiting) -> slots it freed out of `held` (0: it dropped nothing).
MakeRoom = Callable[[Sequence, int, "deque[Sequence]"], int]


class Scheduler:
    def __init__(self, pool: SlotPool, max_num_seqs: int = 256, max_batch_tokens: int = 8192, held: int = 0,
                 make_room: MakeRoom | None = None) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # sum of `reserve` over running sequences
        self.held = held  # slots of idle sessions and of waiting sequences that continue one
        self.make_room = make_room
        self.step_index = 0
        self.peak_running = 0

    def add(self, seq: Sequence) -> None:
        if seq.reserve > self.pool.num_slots:
            # Checked again by the engine before any work starts; this guards direct users of the scheduler.
            raise ValueError(f"sequence needs up to {seq.reserve} KV slots but the pool has {self.pool.num_slots}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, seq: Sequence, batch_tokens: int, prefill_tokens: int) -> bool:
        tokens_fit = batch_tokens + prefill_tokens <= self.max_batch_tokens or batch_tokens == 0
        if len(self.running) >= self.max_num_seqs or not tokens_fit:
            return False
        short = self._shortfall(seq)
        # Dropping sessions helps only when the running reservations alone leave room for this one.
        if short > 0 and self.make_room is not None and self.reserved + seq.reserve <= self.pool.num_slots:
            self.held -= self.make_room(seq, short, self.waiting)
            short = self._shortfall(seq)
        return short <= 0

    def _shortfall(self, seq: Sequence) -> int:
        # A continuing sequence's own held slots are part of its reserve, so they are not counted twice.
        return self.reserved + self.held - len(seq.slots) + seq.reserve - self.pool.num_slots

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(decode=[s for s in self.running])
        tokens = len(batch.decode)
        leaders: dict[int, Sequence] = {}  # request index -> the sequence prefilling its prompt in this step
        while self.waiting:
            seq = self.waiting[0]
            leader = leaders.get(seq.request_index)
            fork = leader is not None and leader.prompt == seq.prompt and not seq.output
            cost = 0 if fork else seq.num_pending
            if not self._fits(seq, tokens, cost):
                break
            self.waiting.popleft()
            self._admit(seq)
            if fork:
                seq.fork_of = leader
                batch.forks.append(seq)
            else:
                batch.prefill.append(seq)
                leaders.setdefault(seq.request_index, seq)
                tokens += cost
        for seq in batch.decode + batch.prefill:
            self._grow(seq, seq.num_pending)
        for seq in batch.forks:
            self._grow(seq, len(seq.prompt))
        self.step_index += 1
        self.peak_running = max(self.peak_running, len(self.running))
        return batch

    def _admit(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.admitted_step = self.step_index
        self.running.append(seq)
        self.reserved += seq.reserve
        self.held -= len(seq.slots)  # a continued session's slots now count in its reservation

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.slots.extend(self.pool.allocate(n))
        seq.peak_slots = max(seq.peak_slots, len(seq.slots))
        assert len(seq.slots) <= seq.reserve, f"sequence {seq.seq_id} outgrew its reservation"

    def release_slots(self, seq: Sequence, slots: list[int]) -> None:
        """Give back slots a compression no longer needs (the sequence keeps its reservation)."""
        self.pool.free(slots)

    def finish(self, seq: Sequence, reason: str, keep: bool = False) -> None:
        """Retire a running sequence; `keep` leaves its slots allocated (the engine holds them as a session)."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.reserved -= seq.reserve
        seq.retained_at_finish = len(seq.slots)
        if keep:
            self.held += len(seq.slots)
            return
        self.pool.free(seq.slots)
        seq.slots = []
