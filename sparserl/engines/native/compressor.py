"""KV compression inside the native engine: when to compress a sequence, and the physical compaction.

The policies in `sparserl/kv` decide *which* entries to keep; this module feeds them (keys from the pool,
the last `window` queries of each layer, logical positions), moves the kept entries into the sequence's
first slots (per layer and per KV head: heads may keep different tokens, since keys carry RoPE already) and
gives the rest back to the pool. New tokens keep their logical positions; only slots are renumbered.

Queries are captured in a ring buffer per (layer, running sequence), written once per layer per step with
one indexed copy. A sequence whose KV the engine keeps as a session hands its state over as a `Carry` (kept
positions and its query window, copied out of the ring) and the next turn's sequence picks it up, so the
compressed cache continues with true logical positions; the new turn's own tokens are its prompt for the
floor (`CompressionSchedule(cfg, new tokens)`), while earlier turns are compressible like generated tokens.
Left out on purpose: compressing at prefill (the first trigger comes with the first decode step past the
floor), cross-request batching of the scoring (each trigger is per request).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparserl.kv import CompressionSchedule, KVPolicyConfig, NewlineTokens, reduce_scores, score_tokens, select_keep
from sparserl.engines.native.scheduler import ScheduledBatch, Scheduler
from sparserl.engines.native.sequence import Sequence


@dataclass
class _SeqState:
    schedule: CompressionSchedule
    row: int  # its row in the query ring buffer
    queries_seen: int = 0
    kept_positions: torch.Tensor | None = None  # (layers, H_kv, K) logical positions of the entries kept last time
    appended_from: int = 0  # logical position of the first entry appended after the last compression


@dataclass
class Carry:
    """A held session's compression state between turns (its entries stay in the pool, in its slots)."""

    kept_positions: torch.Tensor | None  # (layers, H_kv, K), as in `_SeqState`
    appended_from: int
    queries: torch.Tensor | None  # (layers, window, H, D): the sequence's ring row, slot i = query i mod window
    queries_seen: int


class Compressor:
    def __init__(self, cfg: KVPolicyConfig, runner, max_num_seqs: int, tokenizer=None) -> None:
        if cfg.divide_method == "newline" and tokenizer is None:
            raise ValueError("rollout.kv.divide_method=newline needs the engine to have a tokenizer")
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.window = cfg.window
        self.max_rows = max_num_seqs
        self._qbuf: list[torch.Tensor] | None = None  # per layer (rows, window, H, D)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._state: dict[int, _SeqState] = {}
        self._newline = NewlineTokens(cfg.divide_method)

    def max_slots(self, prompt_len: int, max_new_tokens: int, floor_len: int | None = None) -> int:
        return CompressionSchedule.max_slots(self.cfg, prompt_len, max_new_tokens, floor_len)

    def release(self) -> None:
        self._qbuf = None

    # ------------------------------------------------------------ query capture (inside the forward)
    def on_queries(self, batch: ScheduledBatch):
        """Returns the per-layer callback that stores this step's queries of every computed sequence."""
        src, rows, ring = [], [], []
        tok = 0
        for seq in batch.decode + batch.prefill:
            st = self._get(seq)
            n = seq.num_pending
            take = min(n, self.window)
            for i in range(n - take, n):
                src.append(tok + i)
                rows.append(st.row)
                ring.append((st.queries_seen + i) % self.window)
            st.queries_seen += n
            tok += n
        for seq in batch.forks:
            self._get(seq)
        dev = self.runner.device
        src_t, rows_t, ring_t = (torch.tensor(x, dtype=torch.long, device=dev) for x in (src, rows, ring))

        def capture(layer: int, q: torch.Tensor) -> None:  # q: (T, H, D)
            if self._qbuf is None:
                self._allocate(q.shape[1], q.shape[2], q.dtype, q.device)
            self._qbuf[layer][rows_t, ring_t] = q[src_t]

        return capture

    def _allocate(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (self.max_rows, self.window, heads, dim)
        self._qbuf = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.runner.num_layers)]

    def _get(self, seq: Sequence) -> _SeqState:
        st = self._state.get(seq.seq_id)
        if st is None:
            # A continued session's floor protects only this turn's new tokens (see the module docstring).
            schedule = CompressionSchedule(self.cfg, len(seq.prompt) - seq.reused)
            st = _SeqState(schedule, self._free_rows.pop())
            if seq.carry is not None:
                self._resume(st, seq.carry)
                seq.carry = None
            self._state[seq.seq_id] = st
        return st

    def _resume(self, st: _SeqState, carry: Carry) -> None:
        st.kept_positions, st.appended_from, st.queries_seen = carry.kept_positions, carry.appended_from, carry.queries_seen
        if carry.queries is not None:
            if self._qbuf is None:
                _, _, heads, dim = carry.queries.shape
                self._allocate(heads, dim, carry.queries.dtype, carry.queries.device)
            for layer, buf in enumerate(self._qbuf):
                buf[st.row] = carry.queries[layer]

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
        queries = None if self._qbuf is None else torch.stack([buf[st.row] for buf in self._qbuf])  # a copy
        return Carry(st.kept_positions, st.appended_from, queries, st.queries_seen)

    # ------------------------------------------------------------ after the forward
    def after_forward(self, batch: ScheduledBatch) -> None:
        """Siblings start from their leader's prompt queries (before any of them can finish and be detached)."""
        for seq in batch.forks:
            if seq.seq_id in self._state and seq.fork_of.seq_id in self._state and self._qbuf is not None:
                lead, me = self._state[seq.fork_of.seq_id], self._state[seq.seq_id]
                for buf in self._qbuf:
                    buf[me.row] = buf[lead.row]
                me.queries_seen = lead.queries_seen

    # ------------------------------------------------------------ after sampling
    def after_step(self, live: list[Sequence], scheduler: Scheduler) -> None:
        for seq in live:
            st = self._state[seq.seq_id]
            if st.schedule.on_token(len(seq.slots), self._is_newline(seq.output[-1])):
                self.compress(seq, st, scheduler)

    def _is_newline(self, token: int) -> bool:
        return self._newline(token, self.tokenizer)

    def _positions(self, st: _SeqState, n: int) -> torch.Tensor:  # (layers, H_kv, n)
        r = self.runner
        if st.kept_positions is None:
            base = torch.arange(n, device=r.device)
        else:
            k = st.kept_positions.shape[-1]
            tail = torch.arange(st.appended_from, st.appended_from + n - k, device=r.device)
            return torch.cat([st.kept_positions, tail.expand(r.num_layers, r.num_kv_heads, -1)], dim=-1)
        return base.expand(r.num_layers, r.num_kv_heads, n)

    @torch.inference_mode()
    def compress(self, seq: Sequence, st: _SeqState, scheduler: Scheduler) -> None:
        t0 = time.perf_counter()
        r = self.runner
        n = len(seq.slots)
        keep = st.schedule.target_len()
        slots = torch.tensor(seq.slots, dtype=torch.long, device=r.device)
        positions = self._positions(st, n)
        w = min(self.window, st.queries_seen, n)
        order = torch.tensor([(st.queries_seen - w + i) % self.window for i in range(w)], device=r.device)
        shared = self.cfg.share != "head"
        norm = self.cfg.normalize_sums  # shared sets: normalized (paper) or raw (reference) score sums
        scores = []
        for layer in range(r.num_layers):
            keys = r.k_cache[layer][slots].transpose(0, 1)  # (H_kv, n, D)
            queries = self._qbuf[layer][st.row, order].transpose(0, 1)  # (H, w, D)
            scores.append(score_tokens(self.cfg, keys, queries, positions[layer]))
        if self.cfg.share == "all":
            combined = reduce_scores(scores, norm).expand(r.num_kv_heads, -1)
            idx_all = select_keep(combined, keep, w, shared=True, normalize=norm)
        kept_pos = []
        dst = slots[:keep]
        for layer in range(r.num_layers):
            # (H_kv, keep)
            idx = idx_all if self.cfg.share == "all" else select_keep(scores[layer], keep, w, shared, norm)
            heads = torch.arange(r.num_kv_heads, device=r.device)[:, None]
            src = slots[idx]  # (H_kv, keep) physical slot per head
            for cache in (r.k_cache[layer], r.v_cache[layer]):
                gathered = cache[src, heads]  # (H_kv, keep, D), a copy, so the in-place write below is safe
                cache[dst] = gathered.transpose(0, 1)
            kept_pos.append(positions[layer].gather(1, idx))
        st.kept_positions = torch.stack(kept_pos)
        st.appended_from = seq.num_cached
        scheduler.release_slots(seq, seq.slots[keep:])
        seq.slots = seq.slots[:keep]
        seq.slots_version += 1
        seq.compressions += 1
        seq.compressed_at.append(len(seq.output))  # output[k:] is sampled from the compressed cache
        seq.compress_s += time.perf_counter() - t0
