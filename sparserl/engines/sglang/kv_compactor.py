"""KV compression of SGLang requests: per-request triggers and the shared compaction mapped onto SGLang's pool.

Pure torch and plain Python (no sglang import), so it is tested in the main environment; `kv_backend.py` feeds
it from inside SGLang's scheduler process. The policies are `sparserl.kv`'s and so is the compaction
(`sparserl/kv/compaction.py`: query ring, per-request state, selection and the per-head moves), the same code
the native engine runs; this module only maps it onto SGLang's memory layout:

- a request owns one row of `req_to_token` (its "row"), which is also its row of the query ring; entry j of the
  row is the pool slot of its j-th held entry, and the pool's `k_buffer[layer][slot]` is (H_kv, D), post-RoPE.
- compaction keeps `keep` entries per layer and per KV head, written into the row's first `keep` slots; the
  slots of entries keep..n-1 are returned to the caller, which gives them back to SGLang's allocator. The
  row's physical length shrinks to `keep`.
- positions stay logical: `offset[row]` = (tokens the request has cached) - (entries it holds); the backend
  adds it to SGLang's decode positions (physical length - 1), so a new token gets its true RoPE position.
- the schedule steps once per sampled token (`on_token`), from the request's output count, and each
  compaction is kept as an event until the backend reports it (`take_events`).
- `compact_many` compacts the requests due at one step together, in one batched pass (`compact_batch`), each
  with the keep-set it would get alone; `compact` is one request.

Left out on purpose: compressing at prefill (the first trigger comes with the first decode step past the
floor, as in the native engine), and share=layer/all across tensor-parallel ranks (they would need an
all-reduce of the scores; share=head is rank-local because each rank holds whole KV heads).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparserl.kv import CompressionSchedule, KVPolicyConfig
from sparserl.kv.compaction import CaptureIndex, CompactionState, DueRequest, QueryRing, compact_batch


@dataclass
class RequestKV(CompactionState):
    """Compression state of the request that holds one `req_to_token` row."""

    rid: str | None = None
    schedule: CompressionSchedule | None = None  # made on the first sampled token (the prompt length is known then)
    outputs_seen: int = 0  # output tokens already passed to the schedule
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
        self.ring = QueryRing(num_layers, rows, cfg.window)
        self._capture_index: CaptureIndex | None = None  # this forward's, from `plan_capture`

    # ------------------------------------------------------------ inside a forward
    def plan_capture(self, rows: list[int], counts: list[int], fresh: list[bool]) -> None:
        """Before a forward: which query rows of this batch go where in the ring. `counts[i]` tokens of row
        `rows[i]` are computed; `fresh[i]` says the row starts a request (nothing cached before this forward)."""
        for row, new in zip(rows, fresh):
            if new:
                self.begin(row)
        computed = [(row, self.state.setdefault(row, RequestKV()), n) for row, n in zip(rows, counts)]
        self._capture_index = self.ring.plan(computed, self.device)

    def offsets(self, rows: list[int]) -> torch.Tensor:  # (len(rows),) long on the device
        """Logical minus physical length of each row, for this forward's positions (a host-to-device copy)."""
        return torch.tensor([self.offset[r] for r in rows], dtype=torch.long, device=self.device)

    def buffer_bytes(self) -> int:
        """Bytes held by the query ring (0 after `release`)."""
        return self.ring.nbytes()

    def capture(self, layer: int, q: torch.Tensor) -> None:
        """Store this forward's window queries of one layer; q: (T, H_q, D) post-RoPE."""
        self.ring.capture(layer, q, self._capture_index)

    def begin(self, row: int) -> None:
        """A request starts at `row` (a new one, or a retracted one prefilled again from scratch)."""
        self.state[row] = RequestKV()
        self.offset[row] = 0

    def release(self) -> None:
        """Drop the query buffers (the engine sleeps); the next forward allocates them again."""
        self.ring.release()
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

    def compact(self, row: int, slots: torch.Tensor, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                outputs: int, trace: bool = False) -> Compaction:
        """Compress the request at `row`, whose n held entries live in `slots` (n,), down to the schedule's target.

        `k_buffers[l]` / `v_buffers[l]`: the pool's (slots, H_kv, D) tensors of layer l, edited in place. Returns
        the slots to free (the row's entries keep..n-1); the caller frees them and shortens the row.
        """
        return self.compact_many([(row, slots, outputs)], k_buffers, v_buffers, trace)[0]

    @torch.inference_mode()
    def compact_many(self, due: list[tuple[int, torch.Tensor, int]], k_buffers: list[torch.Tensor],
                     v_buffers: list[torch.Tensor], trace: bool = False) -> list[Compaction]:
        """`compact` for every (row, slots, outputs) in `due` at once, in one batched pass (`compact_batch`: the same
        keep-sets as one by one); each request is charged an equal share of the time. The rows must differ."""
        t0 = time.perf_counter()
        work = []
        for row, slots, _ in due:
            st = self.state[row]
            n, keep = slots.shape[0], st.schedule.target_len()
            assert keep < n, f"compaction of row {row} to {keep} entries, but it holds only {n}"
            work.append(DueRequest(st, row, slots, keep, n + self.offset[row]))  # cached: the logical length
        kept = compact_batch(self.cfg, self.ring, work, k_buffers, v_buffers)
        seconds = (time.perf_counter() - t0) / max(1, len(due))
        out = []
        for (row, slots, outputs), item, positions in zip(due, work, kept):
            self.offset[row] = item.cached - item.keep
            item.state.compressions += 1
            item.state.compress_s += seconds
            item.state.events.append((outputs, seconds, positions if trace else None))  # listed when reported
            out.append(Compaction(item.keep, slots[item.keep:].clone(), positions))
        return out

    def take_events(self, row: int) -> list:
        """Compactions of `row` not reported yet: (tokens generated before it, seconds, kept positions or None)."""
        st = self.state.get(row)
        if st is None or not st.events:
            return []
        out, st.events = st.events, []
        return [(n, sec, kept.tolist() if kept is not None else None) for n, sec, kept in out]
