"""Continuous batching: decide, each step, which sequences run and where their new tokens go.

Every step decodes one token for each running sequence and, in the same forward, prefills newly admitted
ones. Siblings of one prompt (`n` samples) are admitted together and copy the first one's prefill. Two
admission rules (`admission`):

- `reserve`: a sequence is admitted while the pool can honour its worst-case need (`Sequence.reserve`: prompt +
  max_new_tokens dense, or the compression bound), so a running sequence never waits for a slot and nothing is
  retracted.
- `optimistic` (the engines' default): also admitted while its current need (the prompt it prefills) fits the
  free slots with `watermark` slots to spare. When the running sequences' next tokens no longer fit, the
  youngest are retracted: their slots go back to the pool and they return to the front of the queue, to be
  prefilled again (prompt + what they generated; a compressed one in stretches that stop where it was compacted,
  `Sequence.replay_ends`). The oldest running sequence is never retracted, so it always advances; a sequence that
  could not be rebuilt by a re-prefill (`retractable=False`) is admitted on its worst case, as under `reserve`.
  Whatever `reserve` would admit, `optimistic` admits too, so the two schedules are the same while the pool
  holds every worst case.

Engine sessions (multi-turn) add `held`: slots owned outside any running reservation, by idle sessions and by
waiting sequences that continue one. Admission counts them like reservations; when they are what stands in
the way, `make_room` (the engine's eviction policy) may drop sessions to free them, before any running sequence
is retracted.

Left out on purpose: swapping KV to host memory (a retracted sequence recomputes), chunked prefill of one
prompt over several steps, priorities. Plain Python: testable without a model.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from sparserl.engines.native.sequence import Sequence, Status
from sparserl.engines.native.slot_pool import PoolExhausted, SlotPool

ADMISSIONS = ("optimistic", "reserve")


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    prefill: list[Sequence] = field(default_factory=list)  # all pending tokens each (resumed ones first)
    forks: list[Sequence] = field(default_factory=list)  # copy their `fork_of`'s prefill after the forward
    retracted: list[Sequence] = field(default_factory=list)  # gave their slots back this step (not computed)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(s.num_pending for s in self.prefill)

    def __len__(self) -> int:
        return len(self.decode) + len(self.prefill) + len(self.forks)


# make_room(head, shortfall, waiting) -> slots it freed out of `held` (0: it dropped nothing). `head` is the
# sequence that needs the room, None when the running sequences' next tokens do.
MakeRoom = Callable[["Sequence | None", int, "deque[Sequence]"], int]
# on_retract(seq): the engine forgets what it holds for a retracted sequence (rows, compression state) and plans
# its re-prefill; called after the scheduler freed its slots.
OnRetract = Callable[[Sequence], None]


class Scheduler:
    def __init__(self, pool: SlotPool, max_num_seqs: int = 256, max_batch_tokens: int = 8192, held: int = 0,
                 make_room: MakeRoom | None = None, admission: str = "optimistic", watermark: float = 0.01,
                 on_retract: OnRetract | None = None) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark is a fraction of the pool in [0, 1), got {watermark}")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # sum of `reserve` over running sequences
        self.held = held  # slots of idle sessions and of waiting sequences that continue one
        self.make_room = make_room
        self.optimistic = admission == "optimistic"
        # Free slots an optimistic admission leaves, so the running sequences decode a while before any retraction.
        self.watermark = math.ceil(watermark * pool.num_slots)
        self.on_retract = on_retract
        self.step_index = 0
        self.peak_running = 0
        self.retractions = 0

    def add(self, seq: Sequence) -> None:
        if seq.reserve > self.pool.num_slots:
            # Checked again by the engine before any work starts; this guards direct users of the scheduler.
            raise ValueError(f"sequence needs up to {seq.reserve} KV slots but the pool has {self.pool.num_slots}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, seq: Sequence, batch_tokens: int, prefill_tokens: int, new_slots: int, step_slots: int) -> bool:
        """Whether `seq` joins this step: `prefill_tokens` it adds to the forward, `new_slots` it allocates, next to
        `step_slots` already promised to this step's other sequences."""
        tokens_fit = batch_tokens + prefill_tokens <= self.max_batch_tokens or batch_tokens == 0
        if len(self.running) >= self.max_num_seqs or not tokens_fit:
            return False
        short = self._shortfall(seq)
        if short <= 0:
            return True  # its worst case fits next to every running one's
        if self.optimistic and seq.retractable:
            return self._room(seq, step_slots + new_slots + self.watermark - self.pool.num_free) <= 0
        # Dropping sessions helps only when the running reservations alone leave room for this one.
        if self.reserved + seq.reserve <= self.pool.num_slots:
            short = self._room(seq, short, self._shortfall)
        return short <= 0

    def _room(self, head: Sequence | None, short: int, again: Callable[[Sequence], int] | None = None) -> int:
        """Ask `make_room` to drop held sessions for `short` slots; returns what is still short (`again(head)`,
        or `short` less what was freed)."""
        if short <= 0 or self.make_room is None:
            return short
        freed = self.make_room(head, short, self.waiting)
        self.held -= freed
        return again(head) if again is not None else short - freed

    def _shortfall(self, seq: Sequence) -> int:
        # A continuing sequence's own held slots are part of its reserve, so they are not counted twice.
        return self.reserved + self.held - len(seq.slots) + seq.reserve - self.pool.num_slots

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.optimistic:
            batch.retracted = self._retract_for_growth()
        for seq in self.running:
            # Decoding sequences feed their last sample; resumed ones prefill their next stretch.
            (batch.decode if seq.decoding else batch.prefill).append(seq)
        tokens = len(batch.decode) + sum(s.num_pending for s in batch.prefill)
        slots = tokens
        leaders: dict[int, Sequence] = {}  # request index -> the sequence prefilling its prompt in this step
        while self.waiting and not batch.retracted:  # a step that retracted admits nothing
            seq = self.waiting[0]
            leader = leaders.get(seq.request_index)
            fork = leader is not None and leader.prompt == seq.prompt and not seq.output
            cost = 0 if fork else seq.num_pending
            new = len(seq.prompt) if fork else seq.num_pending
            if not self._fits(seq, tokens, cost, new, slots):
                break
            self.waiting.popleft()
            self._admit(seq)
            if fork:
                seq.fork_of = leader
                batch.forks.append(seq)
            else:
                batch.prefill.append(seq)
                if not seq.output:  # a resumed sequence's queries are not its prompt's: it leads no siblings
                    leaders.setdefault(seq.request_index, seq)
                tokens += cost
            slots += new
        for seq in batch.decode + batch.prefill:
            self._grow(seq, seq.num_pending)
        for seq in batch.forks:
            self._grow(seq, len(seq.prompt))
        self.step_index += 1
        self.peak_running = max(self.peak_running, len(self.running))
        return batch

    def _retract_for_growth(self) -> list[Sequence]:
        """Make room for the running sequences' next tokens: drop held sessions (`make_room`), then retract the
        youngest retractable sequences, never the oldest running one. Returns the retracted ones, youngest first."""
        need = sum(s.num_pending for s in self.running)
        if need <= self.pool.num_free:
            return []
        self._room(None, need - self.pool.num_free)
        retracted = []
        victims = [s for s in self.running[1:] if s.retractable]
        while need > self.pool.num_free and victims:
            seq = victims.pop()
            need -= seq.num_pending
            self._retract(seq)
            retracted.append(seq)
        if need > self.pool.num_free:
            oldest = self.running[0]
            raise PoolExhausted(
                f"the KV pool ({self.pool.num_slots} slots) cannot hold the next tokens of the running sequences: "
                f"{self.pool.num_free} free, {need} needed, {self.held} held by sessions, the oldest sequence at "
                f"{len(oldest.slots)} slots of its worst case {oldest.reserve}"
                + (", and sequences that cannot be retracted (compressed session continuations)"
                   if any(not s.retractable for s in self.running) else "")
                + "; raise rollout.kv_memory (or rollout.kv_pool_tokens), or end sessions earlier")
        return retracted

    def _retract(self, seq: Sequence) -> None:
        """Take a running sequence back to the front of the queue; its slots go back to the pool and its tokens so
        far (prompt + output) will be prefilled again."""
        self.running.remove(seq)
        self.reserved -= seq.reserve
        self.pool.free(seq.slots)
        seq.slots = []
        seq.slots_version += 1
        seq.recomputed += seq.num_cached
        seq.num_cached = 0
        seq.fork_of = None
        seq.status = Status.WAITING
        seq.retractions += 1
        self.retractions += 1
        if self.on_retract is not None:
            self.on_retract(seq)
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.admitted_step = self.step_index
        self.running.append(seq)
        self.reserved += seq.reserve
        self.held -= len(seq.slots)  # a continued session's slots now count in its reservation

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.slots.extend(self.pool.allocate(n))
        seq.peak_slots = max(seq.peak_slots, len(seq.slots))
        assert len(seq.slots) <= seq.reserve, f"sequence {seq.seq_id} outgrew its worst case"

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
