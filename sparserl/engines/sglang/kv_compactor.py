"""KV compression of SGLang requests: per-request triggers, query windows, selection and physical compaction.

Pure torch and plain Python (no sglang import), so it is tested in the main environment; `kv_backend.py` feeds
it from inside SGLang's scheduler process. The policies are `sparserl.kv`'s, the same functions the native
engine calls (`score_tokens`, `select_keep`, `reduce_scores`, `CompressionSchedule`); this module only maps
them onto SGLang's memory layout:

- a request owns one row of `req_to_token` (its "row"); entry j of the row is the pool slot of its j-th held
  entry, and the pool's `k_buffer[layer][slot]` is (H_kv, D), post-RoPE.
- compaction keeps `keep` entries per layer and per KV head (heads may keep different tokens: keys carry their
  RoPE already), written into the row's first `keep` slots; the slots of entries keep..n-1 are returned to the
  caller, which gives them back to SGLang's allocator. The row's physical length shrinks to `keep`.
- positions stay logical: `offset[row]` = (tokens the request has cached) - (entries it holds); the backend
  adds it to SGLang's decode positions (physical length - 1), so a new token gets its true RoPE position.
- the last `window` queries of every layer are kept per row in a ring buffer, written once per layer per
  forward with one indexed copy (`capture`), as the native engine does.

Left out on purpose: compressing at prefill (the first trigger comes with the first decode step past the
floor, as in the native engine), cross-request batching of the scoring (each trigger is per request), and
share=layer/all across tensor-parallel ranks (they would need an all-reduce of the scores; share=head is
rank-local because each rank holds whole KV heads).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparserl.kv import CompressionSchedule, KVPolicyConfig, reduce_scores, score_tokens, select_keep


@dataclass
class RequestKV:
    """Compression state of the request that holds one `req_to_token` row."""

    rid: str | None = None
    schedule: CompressionSchedule | None = None  # made on the first sampled token (the prompt length is known then)
    queries_seen: int = 0
    outputs_seen: int = 0  # output tokens already passed to the schedule
    kept_positions: torch.Tensor | None = None  # (layers, H_kv, K) logical positions kept by the last compaction
    appended_from: int = 0  # logical position of the first entry appended after the last compaction
    compressions: int = 0
    compress_s: float = 0.0
    events: list = field(default_factory=list)  # (output length, seconds, kept positions or None) not yet reported


@dataclass
class Compaction:
    """What one compaction did: entries kept (per layer, per head), slots to free, kept logical positions."""

    keep: int
    freed: torch.Tensor  # (n - keep,) pool slots, long
    kept_positions: torch.Tensor  # (layers, H_kv, keep)


class KVCompactor:
    def __init__(self, cfg: KVPolicyConfig, num_layers: int, num_kv_heads: int, rows: int, device) -> None:
        if cfg.algorithm == "none":
            raise ValueError("KVCompactor needs a compression policy (rollout.kv.algorithm other than none)")
        self.cfg = cfg
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.rows = rows
        self.device = torch.device(device)
        self.window = cfg.window
        self.offset = [0] * rows  # logical - physical length, per row; on the host (read without a device sync)
        self.state: dict[int, RequestKV] = {}
        self._qbuf: list[torch.Tensor] | None = None  # per layer (rows, window, H_q, D)
        self._capture_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ inside a forward
    def plan_capture(self, rows: list[int], counts: list[int], fresh: list[bool]) -> None:
        """Before a forward: which query rows of this batch go where in the ring. `counts[i]` tokens of row
        `rows[i]` are computed; `fresh[i]` says the row starts a request (nothing cached before this forward)."""
        src, dst_row, dst_ring = [], [], []
        tok = 0
        for row, n, new in zip(rows, counts, fresh):
            if new:
                self.begin(row)
            st = self.state.setdefault(row, RequestKV())
            take = min(n, self.window)
            for i in range(n - take, n):
                src.append(tok + i)
                dst_row.append(row)
                dst_ring.append((st.queries_seen + i) % self.window)
            st.queries_seen += n
            tok += n
        self._capture_index = tuple(torch.tensor(x, dtype=torch.long, device=self.device) for x in (src, dst_row, dst_ring))

    def offsets(self, rows: list[int]) -> torch.Tensor:  # (len(rows),) long on the device
        """Logical minus physical length of each row, for this forward's positions (a host-to-device copy)."""
        return torch.tensor([self.offset[r] for r in rows], dtype=torch.long, device=self.device)

    def buffer_bytes(self) -> int:
        """Bytes held by the query ring (0 after `release`)."""
        return sum(b.numel() * b.element_size() for b in self._qbuf) if self._qbuf is not None else 0

    def capture(self, layer: int, q: torch.Tensor) -> None:
        """Store this forward's window queries of one layer; q: (T, H_q, D) post-RoPE."""
        if self._qbuf is None:
            shape = (self.rows, self.window, q.shape[1], q.shape[2])
            self._qbuf = [torch.zeros(shape, dtype=q.dtype, device=q.device) for _ in range(self.num_layers)]
        src, row, ring = self._capture_index
        self._qbuf[layer][row, ring] = q[src]

    def begin(self, row: int) -> None:
        """A request starts at `row` (a new one, or a retracted one prefilled again from scratch)."""
        self.state[row] = RequestKV()
        self.offset[row] = 0

    def release(self) -> None:
        """Drop the query buffers (the engine sleeps); the next forward allocates them again."""
        self._qbuf = None
        self._capture_index = None

    # ------------------------------------------------------------ after sampling
    def on_token(self, row: int, rid: str, prompt_len: int, outputs: int, held: int, newline: bool) -> bool:
        """The request at `row` has `outputs` sampled tokens and holds `held` entries; True: compact it now."""
        st = self.state.setdefault(row, RequestKV())
        if st.rid != rid:
            st.rid = rid
        if st.schedule is None:
            st.schedule = CompressionSchedule(self.cfg, prompt_len)
            st.outputs_seen = outputs - 1
        due = False
        while st.outputs_seen < outputs:  # one schedule step per sampled token (one per forward in practice)
            st.outputs_seen += 1
            due = st.schedule.on_token(held, newline) or due
        return due

    def positions(self, st: RequestKV, n: int) -> torch.Tensor:  # (layers, H_kv, n) logical positions
        if st.kept_positions is None:
            return torch.arange(n, device=self.device).expand(self.num_layers, self.num_kv_heads, n)
        k = st.kept_positions.shape[-1]
        tail = torch.arange(st.appended_from, st.appended_from + n - k, device=self.device)
        return torch.cat([st.kept_positions, tail.expand(self.num_layers, self.num_kv_heads, -1)], dim=-1)

    @torch.inference_mode()
    def compact(self, row: int, slots: torch.Tensor, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                outputs: int, trace: bool = False) -> Compaction:
        """Compress the request at `row`, whose n held entries live in `slots` (n,), down to the schedule's target.

        `k_buffers[l]` / `v_buffers[l]`: the pool's (slots, H_kv, D) tensors of layer l, edited in place. Returns
        the slots to free (the row's entries keep..n-1); the caller frees them and shortens the row.
        """
        t0 = time.perf_counter()
        st = self.state[row]
        n = slots.shape[0]
        keep = st.schedule.target_len()
        assert keep < n, f"compaction of row {row} to {keep} entries, but it holds only {n}"
        positions = self.positions(st, n)
        w = min(self.window, st.queries_seen, n)
        order = torch.tensor([(st.queries_seen - w + i) % self.window for i in range(w)], device=self.device)
        shared = self.cfg.share != "head"
        norm = self.cfg.normalize_sums  # shared sets: normalized (paper) or raw (reference) score sums
        scores = []
        for layer in range(self.num_layers):
            keys = k_buffers[layer][slots].transpose(0, 1)  # (H_kv, n, D)
            queries = self._qbuf[layer][row, order].transpose(0, 1)  # (H_q, w, D)
            scores.append(score_tokens(self.cfg, keys, queries, positions[layer]))
        if self.cfg.share == "all":
            combined = reduce_scores(scores, norm).expand(self.num_kv_heads, -1)
            idx_all = select_keep(combined, keep, w, shared=True, normalize=norm)
        heads = torch.arange(self.num_kv_heads, device=self.device)[:, None]
        dst = slots[:keep]
        kept = []
        for layer in range(self.num_layers):
            # (H_kv, keep)
            idx = idx_all if self.cfg.share == "all" else select_keep(scores[layer], keep, w, shared, norm)
            src = slots[idx]  # (H_kv, keep): the pool slot each head reads its j-th kept entry from
            for buf in (k_buffers[layer], v_buffers[layer]):
                gathered = buf[src, heads]  # (H_kv, keep, D), a copy, so the in-place write below is safe
                buf[dst] = gathered.transpose(0, 1)
            kept.append(positions[layer].gather(1, idx))
        st.kept_positions = torch.stack(kept)
        cached = n + self.offset[row]  # tokens the request has cached so far (logical length)
        st.appended_from = cached
        self.offset[row] = cached - keep
        st.compressions += 1
        seconds = time.perf_counter() - t0
        st.compress_s += seconds
        st.events.append((outputs, seconds, st.kept_positions if trace else None))  # listed when reported
        return Compaction(keep, slots[keep:].clone(), st.kept_positions)

    def take_events(self, row: int) -> list:
        """Compactions of `row` not reported yet: (tokens generated before it, seconds, kept positions or None)."""
        st = self.state.get(row)
        if st is None or not st.events:
            return []
        out, st.events = st.events, []
        return [(n, sec, kept.tolist() if kept is not None else None) for n, sec, kept in out]
