"""KV compression inside the native engine: when to compress a sequence, and its adapter to the shared compaction.

The policies in `sparserl/kv` decide *which* entries to keep, and `sparserl/kv/compaction.py` holds the query
ring, the per-request state and the compaction itself; this module maps them onto the native pool. A running
sequence takes a row of the query ring from a free list (the engine admits at most `max_num_seqs`); its slots
are `seq.slots`, and the runner's per-layer `k_cache` / `v_cache` are the (slots, H_kv, D) tensors compaction
reads and edits. After a compaction the sequence's first `keep` slots hold the kept entries (per layer and KV
head) and the rest go back to the pool through the scheduler. New tokens keep their logical positions; only
slots are renumbered.

A sequence whose KV the engine keeps as a session hands its state over as a `Carry` (kept positions and its
query window, copied out of the ring) and the next turn's sequence picks it up, so the compressed cache
continues with true logical positions; the new turn's own tokens are its prompt for the floor
(`CompressionSchedule(cfg, new tokens)`), while earlier turns are compressible like generated tokens. Forked
siblings start from their leader's prompt queries. The sequences due after a step are compacted together, in one
batched pass (`compact_batch`), each with the keep-set it would get alone.
A retracted sequence (optimistic admission, scheduler.py) is rebuilt, not re-compressed from scratch: its
re-prefill stops at each logical length where it was compacted (`Sequence.replay_ends`), and `replay_due`
compacts it there as `after_step` did the first time: the same tokens went through the model, the same window
queries score the same keys over the same logical positions, so it keeps the same entries (up to rounding, which
the kernels of a re-prefill do not reproduce bit for bit, against an exact tie) and the rebuilt cache is the one
that drew its tokens. Its schedule resumes where it stood (`steps_since`); replayed compactions are not counted
again in `compressions` or `compressed_at`, only their time.
Left out on purpose: compressing at prefill (the first trigger comes with the first decode step past the
floor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparserl.kv import CompressionSchedule, KVPolicyConfig, NewlineTokens
from sparserl.kv.compaction import CompactionState, DueRequest, QueryRing, compact_batch
from sparserl.engines.native.scheduler import ScheduledBatch, Scheduler
from sparserl.engines.native.sequence import Sequence


@dataclass(kw_only=True)
class _SeqState(CompactionState):
    schedule: CompressionSchedule
    row: int  # its row in the query ring


@dataclass(kw_only=True)
class Carry(CompactionState):
    """A held session's compression state between turns (its entries stay in the pool, in its slots)."""

    queries: torch.Tensor | None  # (layers, window, H, D): the sequence's ring row (`QueryRing.copy_out`)


class Compressor:
    def __init__(self, cfg: KVPolicyConfig, runner, max_num_seqs: int, tokenizer=None) -> None:
        if cfg.divide_method == "newline" and tokenizer is None:
            raise ValueError("rollout.kv.divide_method=newline needs the engine to have a tokenizer")
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.window = cfg.window
        self.max_rows = max_num_seqs
        self.ring = QueryRing(runner.num_layers, max_num_seqs, cfg.window)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._state: dict[int, _SeqState] = {}
        self._newline = NewlineTokens(cfg.divide_method)

    def max_slots(self, prompt_len: int, max_new_tokens: int, floor_len: int | None = None,
                  cfg: KVPolicyConfig | None = None) -> int:
        """Worst-case slots under `cfg` (a sequence's own, `Sequence.kv`), by default the compressor's."""
        return CompressionSchedule.max_slots(cfg or self.cfg, prompt_len, max_new_tokens, floor_len)

    def release(self) -> None:
        self.ring.release()

    # ------------------------------------------------------------ query capture (inside the forward)
    def on_queries(self, batch: ScheduledBatch):
        """Returns the per-layer callback that stores this step's queries of every computed sequence."""
        computed = [(st.row, st, seq.num_pending) for seq in batch.decode + batch.prefill for st in [self._get(seq)]]
        index = self.ring.plan(computed, self.runner.device)
        for seq in batch.forks:
            self._get(seq)
        return lambda layer, q: self.ring.capture(layer, q, index)  # q: (T, H, D)

    def decode_places(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """A decode-only step (one new token per sequence): each sequence's ring row and the place its query takes
        in the row's window, as `QueryRing.plan` gives them for one token; counts the query in its state. The
        caller writes the queries with `QueryRing.capture_rows`."""
        rows, places = [], []
        for seq in seqs:
            st = self._get(seq)
            rows.append(st.row)
            places.append(st.queries_seen % self.window)
            st.queries_seen += 1
        return rows, places

    def _get(self, seq: Sequence) -> _SeqState:
        st = self._state.get(seq.seq_id)
        if st is None:
            # A continued session's floor protects only this turn's new tokens (see the module docstring).
            st = _SeqState(schedule=CompressionSchedule(seq.kv or self.cfg, len(seq.prompt) - seq.reused),
                           row=self._free_rows.pop())
            if seq.carry is not None:
                self._resume(st, seq.carry)
                seq.carry = None
            if seq.output:  # a retracted sequence coming back: its schedule goes on where it stood
                st.schedule.steps_since = len(seq.output) - (seq.compressed_at[-1] if seq.compressed_at else 0)
            self._state[seq.seq_id] = st
        return st

    def _resume(self, st: _SeqState, carry: Carry) -> None:
        st.kept_positions, st.appended_from, st.queries_seen = carry.kept_positions, carry.appended_from, carry.queries_seen
        if carry.queries is not None:
            self.ring.copy_in(st.row, carry.queries)

    def forget(self, seq: Sequence) -> None:
        st = self._state.pop(seq.seq_id, None)
        if st is not None:
            self._free_rows.append(st.row)

    def detach(self, seq: Sequence) -> Carry | None:
        """Hand a finished sequence's state over to the session that keeps its KV; frees its ring row."""
        st = self._state.pop(seq.seq_id, None)
        if st is None:
            return None
        self._free_rows.append(st.row)
        return Carry(queries_seen=st.queries_seen, kept_positions=st.kept_positions, appended_from=st.appended_from,
                     queries=self.ring.copy_out(st.row))

    # ------------------------------------------------------------ after the forward
    def after_forward(self, batch: ScheduledBatch) -> None:
        """Siblings start from their leader's prompt queries (before any of them can finish and be detached)."""
        for seq in batch.forks:
            if seq.seq_id in self._state and seq.fork_of.seq_id in self._state and self.ring.allocated:
                lead, me = self._state[seq.fork_of.seq_id], self._state[seq.seq_id]
                self.ring.copy_row(lead.row, me.row)
                me.queries_seen = lead.queries_seen

    # ------------------------------------------------------------ after sampling
    def after_step(self, live: list[Sequence], scheduler: Scheduler) -> None:
        """Step every live sequence's schedule; compact all the due ones together."""
        due = []
        for seq in live:
            st = self._state[seq.seq_id]
            if st.schedule.on_token(len(seq.slots), self._is_newline(seq.output[-1])):
                due.append((seq, st))
        if due:
            self.compress_all(due, scheduler)

    def replay_due(self, prefilled: list[Sequence], scheduler: Scheduler) -> None:
        """Resumed sequences whose re-prefill reached a length where they were compacted: compact them there again."""
        due = []
        for seq in prefilled:
            if seq.replay_ends and seq.num_cached == seq.replay_ends[0]:
                seq.replay_ends.pop(0)
                due.append((seq, self._state[seq.seq_id]))
        if due:
            self.compress_all(due, scheduler, replay=True)

    def _is_newline(self, token: int) -> bool:
        return self._newline(token, self.tokenizer)

    def compress(self, seq: Sequence, st: _SeqState, scheduler: Scheduler) -> None:
        """Compact one sequence now (`compress_all` with one)."""
        self.compress_all([(seq, st)], scheduler)

    @torch.inference_mode()
    def compress_all(self, due: list[tuple[Sequence, _SeqState]], scheduler: Scheduler, replay: bool = False) -> None:
        """Compact the due sequences in one batched pass (`compact_batch`: the keep-sets each would get alone), then
        free each one's evicted slots in order. Each is charged an equal share of the pass's time. `replay`: a
        resumed sequence's compaction done again (`replay_due`), not counted as a new one."""
        t0 = time.perf_counter()
        r = self.runner
        work = [DueRequest(st, st.row, torch.tensor(seq.slots, dtype=torch.long, device=r.device),
                           st.schedule.target_len(), seq.num_cached) for seq, st in due]
        compact_batch(self.cfg, self.ring, work, r.k_cache, r.v_cache)
        seconds = (time.perf_counter() - t0) / len(due)
        for (seq, _), item in zip(due, work):
            scheduler.release_slots(seq, seq.slots[item.keep:])
            seq.slots = seq.slots[:item.keep]
            seq.slots_version += 1
            seq.compress_s += seconds
            if not replay:
                seq.compressions += 1
                seq.compressed_at.append(len(seq.output))  # output[k:] is sampled from the compressed cache
