"""KV compaction of requests in a slot pool: its query window, the logical positions of what it holds, and
the entries each layer and KV head keeps. Pure torch; both engines adapt it to their memory.

The pool it works on is one tensor per layer, (slots, H_kv, D), keys post-RoPE, as the native engine's
`k_cache` / `v_cache` and SGLang's `k_buffer` / `v_buffer` are; a request's n held entries are a (n,) long
tensor of its slots in entry order (the native sequence's `slots`, SGLang's `req_to_token` row). A layer may
also be a quantized `KVStore` (rollout.kv_dtype, kv/kv_dtype.py): keys are scored as `read_entries` dequantizes
them, and the moves carry each entry's codes and scales together (`entry_parts`).

- `QueryRing`: the last `window` queries of every layer per ring row (one row per running request, plus one
  spare row no request owns), (rows + 1, window, H_q, D) per layer, allocated by the first capture. `plan` maps
  a forward's tokens to ring places once; `capture` then writes a layer with one indexed copy (`capture_rows`:
  one query per row, places given). A row is read oldest query first, copied out and back in (a held session),
  or copied from another row (a fork).
- `CompactionState`: what a request carries between compactions: queries seen, the logical positions of the
  entries kept last time, per layer and KV head (heads may keep different tokens, since keys carry their RoPE
  already), and the logical position of the first entry appended after it; appended entries are consecutive.
- `select_entries`: one request, layer by layer: every layer's `score_tokens` (window queries against the held
  keys), then `select_keep` per head, per layer (share=layer) or once per request over `reduce_scores`
  (share=all): per layer the (H_kv, keep) entry indices and their logical positions. It is the definition the
  batched selection reproduces.
- `compact_batch`: every request due at a step at once. `batch_chunks` groups them by shape (entries held, window
  queries, keep); `select_batch` scores a chunk with one pass per layer, the requests folded into the head dim,
  and picks each request's keep-set exactly as `select_entries` would; `move_entries` then moves the selection of
  all of them into each request's first `keep` slots, per layer and per head, with one gather and one scatter per
  buffer, and the states record it. New tokens keep their logical positions; only slots are renumbered.
  `compact_entries` is the same for one request.

An engine adapter supplies the slots and buffers, steps the `CompressionSchedule`, and frees the slots of
entries keep..n-1 to its own allocator.
Left out on purpose: slot allocation and freeing, triggers and admission (the engines' own), compressing at
prefill, and padding rows of different lengths into one chunk (it would change reduction and tie orders, so
the keep-sets; such requests are scored in chunks of their own).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.kv.base import KVPolicyConfig, reduce_scores, score_tokens, select_keep
from sparserl.kv.kv_dtype import entry_parts, read_entries

CaptureIndex = tuple[Tensor, Tensor, Tensor]  # (token in the forward, ring row, place in the row's window), long


@dataclass
class CompactionState:
    """A request's compaction state (the engines extend it with their own bookkeeping)."""

    queries_seen: int = 0  # tokens whose queries went through the ring; the window holds the last of them
    kept_positions: Tensor | None = None  # (layers, H_kv, K) logical positions of the entries kept last time
    appended_from: int = 0  # logical position of the first entry appended after the last compaction

    def positions(self, n: int, num_layers: int, num_kv_heads: int, device) -> Tensor:
        """(layers, H_kv, n) logical positions of the n held entries: the kept ones, then the appended ones."""
        if self.kept_positions is None:
            return torch.arange(n, device=device).expand(num_layers, num_kv_heads, n)
        k = self.kept_positions.shape[-1]
        tail = torch.arange(self.appended_from, self.appended_from + n - k, device=device)
        return torch.cat([self.kept_positions, tail.expand(num_layers, num_kv_heads, -1)], dim=-1)


class QueryRing:
    """Per layer (rows + 1, window, H_q, D): row r's query i sits at place i mod window. Row `spare_row` (== rows)
    belongs to no request: a batch padded to a fixed size writes its padding rows' queries there."""

    def __init__(self, num_layers: int, rows: int, window: int) -> None:
        self.num_layers = num_layers
        self.rows = rows
        self.spare_row = rows
        self.window = window
        self.buffers: list[Tensor] | None = None  # per layer; None until the first capture (or after `release`)

    @property
    def allocated(self) -> bool:
        return self.buffers is not None

    def allocate(self, heads: int, dim: int, dtype: torch.dtype, device) -> None:
        shape = (self.rows + 1, self.window, heads, dim)
        # Kept across forwards: made as normal tensors, so that a capture under inference mode and a read or copy-in
        # outside it (SGLang picks its own grad mode) may both touch them.
        with torch.inference_mode(False):
            self.buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

    def release(self) -> None:
        """Drop the buffers (the engine sleeps); the next capture allocates them again."""
        self.buffers = None

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers) if self.buffers is not None else 0

    def plan(self, computed: Iterable[tuple[int, CompactionState, int]], device) -> CaptureIndex:
        """Where one forward's queries go. `computed`: (ring row, state, tokens computed) per request, in the
        forward's token order; each request's last `window` tokens are stored, and its state counts them all."""
        src, rows, places = [], [], []
        tok = 0
        for row, st, n in computed:
            for i in range(n - min(n, self.window), n):
                src.append(tok + i)
                rows.append(row)
                places.append((st.queries_seen + i) % self.window)
            st.queries_seen += n
            tok += n
        return tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (src, rows, places))

    def capture(self, layer: int, q: Tensor, index: CaptureIndex) -> None:
        """Store one layer's planned queries; q: (T, H_q, D) post-RoPE, T the forward's tokens."""
        if self.buffers is None:
            self.allocate(q.shape[1], q.shape[2], q.dtype, q.device)
        src, rows, places = index
        self.buffers[layer][rows, places] = q[src]

    def capture_rows(self, layer: int, q: Tensor, rows: Tensor, places: Tensor) -> None:
        """Store one query per row: q (B, H_q, D) post-RoPE, rows and places (B,) long on q's device."""
        if self.buffers is None:
            self.allocate(q.shape[1], q.shape[2], q.dtype, q.device)
        self.buffers[layer][rows, places] = q

    def window_order(self, queries_seen: int, n: int, device) -> Tensor:
        """(w,) places of a row's last w = min(window, queries_seen, n) queries, oldest first."""
        w = min(self.window, queries_seen, n)
        return torch.tensor([(queries_seen - w + i) % self.window for i in range(w)], dtype=torch.long, device=device)

    def read(self, layer: int, row: int, order: Tensor) -> Tensor:
        """(H_q, w, D) the queries of `row` at `order` (see `window_order`)."""
        return self.buffers[layer][row, order].transpose(0, 1)

    def copy_out(self, row: int) -> Tensor | None:
        """(layers, window, H_q, D) a copy of `row`, places as in the ring; None before any capture."""
        return None if self.buffers is None else torch.stack([buf[row] for buf in self.buffers])

    def copy_in(self, row: int, queries: Tensor) -> None:
        """Write a `copy_out` result into `row`, allocating the buffers with its shape if needed."""
        if self.buffers is None:
            _, _, heads, dim = queries.shape
            self.allocate(heads, dim, queries.dtype, queries.device)
        for layer, buf in enumerate(self.buffers):
            buf[row] = queries[layer]

    def copy_row(self, src: int, dst: int) -> None:
        if self.buffers is not None:
            for buf in self.buffers:
                buf[dst] = buf[src]


def select_entries(cfg: KVPolicyConfig, state: CompactionState, ring: QueryRing, row: int, slots: Tensor,
                   k_buffers: list[Tensor], keep: int) -> tuple[list[Tensor], Tensor]:
    """Which of the n entries held in `slots` (n,) each layer and KV head keeps, scored with ring row `row`.

    Returns per layer the (H_kv, keep) entry indices (rows sorted, the window last) and the (layers, H_kv, keep)
    logical positions of those entries.
    """
    n = slots.shape[0]
    num_layers, num_kv_heads = len(k_buffers), k_buffers[0].shape[1]
    positions = state.positions(n, num_layers, num_kv_heads, slots.device)
    order = ring.window_order(state.queries_seen, n, slots.device)
    w = order.shape[0]
    scores = []
    for layer in range(num_layers):
        keys = read_entries(k_buffers[layer], slots).transpose(0, 1)  # (H_kv, n, D)
        scores.append(score_tokens(cfg, keys, ring.read(layer, row, order), positions[layer]))
    shared = cfg.share != "head"
    norm = cfg.normalize_sums  # shared sets: normalized (paper) or raw (reference) score sums
    if cfg.share == "all":
        combined = reduce_scores(scores, norm).expand(num_kv_heads, -1)
        indices = [select_keep(combined, keep, w, shared=True, normalize=norm)] * num_layers
    else:
        indices = [select_keep(layer_scores, keep, w, shared, norm) for layer_scores in scores]
    kept = torch.stack([positions[layer].gather(1, idx) for layer, idx in enumerate(indices)])
    return indices, kept


# Scoring works on a whole chunk of same-shape requests at once; R-KV's redundancy holds (rows * H_kv, n, n) floats,
# so a chunk is cut to about this many of them (one request per chunk at the least). On a CPU, where a pass costs
# its arithmetic and memory traffic rather than its launches, chunks stay small enough for the caches.
CHUNK_SCORE_ELEMENTS = 1 << 27
CPU_CHUNK_SCORE_ELEMENTS = 1 << 21


@dataclass
class DueRequest:
    """A request due for compaction: its state and ring row, its n held entries' slots (n,) long, the entries to keep
    per layer and KV head, and its logical length (where the entries appended from now on start)."""

    state: CompactionState
    row: int
    slots: Tensor
    keep: int
    cached: int


def batch_chunks(due: list[DueRequest], window: int, num_kv_heads: int) -> list[list[int]]:
    """Indices into `due`, grouped by (n held, window queries, keep) and cut to the chunk bound: the requests
    one `select_batch` call scores together. Same shapes only: padding a row would change its reductions' order
    (softmax sums, means) and the top-k's tie order, and so the keep-set."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, d in enumerate(due):
        n = d.slots.shape[0]
        groups.setdefault((n, min(window, d.state.queries_seen, n), d.keep), []).append(i)
    chunks = []
    bound = CPU_CHUNK_SCORE_ELEMENTS if due and due[0].slots.device.type == "cpu" else CHUNK_SCORE_ELEMENTS
    for (n, _, _), members in groups.items():
        size = max(1, bound // (num_kv_heads * n * n))
        chunks += [members[i:i + size] for i in range(0, len(members), size)]
    return chunks


def select_batch(cfg: KVPolicyConfig, ring: QueryRing, due: list[DueRequest], k_buffers: list[Tensor]
                 ) -> tuple[Tensor, Tensor]:
    """`select_entries` for b requests holding the same n entries, with the same window and keep, in one pass per
    layer: the batch is folded into the head dim ((b * H_kv, n, D) keys, (b * H_q, w, D) queries), which every
    policy scores row by row, so each request's scores and keep-set are the ones it gets alone.

    Returns the (b, layers, H_kv, keep) entry indices and their logical positions.
    """
    b, n, keep = len(due), due[0].slots.shape[0], due[0].keep
    num_layers, num_kv_heads = len(k_buffers), k_buffers[0].shape[1]
    device = due[0].slots.device
    slots = torch.stack([d.slots for d in due])  # (b, n)
    positions = torch.stack([d.state.positions(n, num_layers, num_kv_heads, device) for d in due])  # (b, L, H, n)
    w = min(ring.window, due[0].state.queries_seen, n)
    orders = [[(d.state.queries_seen - w + i) % ring.window for i in range(w)] for d in due]  # as `window_order`
    orders = torch.tensor(orders, dtype=torch.long, device=device)  # (b, w)
    rows = torch.tensor([d.row for d in due], dtype=torch.long, device=device)[:, None]
    scores = []
    for layer in range(num_layers):
        keys = read_entries(k_buffers[layer], slots).transpose(1, 2).flatten(0, 1)  # (b * H_kv, n, D)
        queries = ring.buffers[layer][rows, orders].transpose(1, 2).flatten(0, 1)  # (b * H_q, w, D)
        layer_scores = score_tokens(cfg, keys, queries, positions[:, layer].flatten(0, 1))
        scores.append(layer_scores.view(b, num_kv_heads, n))
    shared, norm = cfg.share != "head", cfg.normalize_sums
    if cfg.share == "all":
        combined = select_keep(reduce_scores(scores, norm), keep, w, shared=True, normalize=norm)
        indices = combined.unsqueeze(1).expand(b, num_layers, num_kv_heads, keep)
    else:
        indices = torch.stack([select_keep(layer_scores, keep, w, shared, norm) for layer_scores in scores], dim=1)
    return indices, positions.gather(-1, indices)


def move_entries(moves: list[tuple[Tensor, Tensor]], k_buffers: list[Tensor], v_buffers: list[Tensor]) -> None:
    """Each head's kept entries into its request's first `keep` slots, for every request at once: per layer one
    gather and one scatter of K and of V. moves: per chunk, its (b, n) slots and (b, layers, H_kv, keep) indices.
    The requests' slots must be disjoint (each owns its own)."""
    num_layers, num_kv_heads = len(k_buffers), k_buffers[0].shape[1]
    srcs, dsts = [], []
    for slots, indices in moves:
        b, keep = slots.shape[0], indices.shape[-1]
        src = slots[:, None, None, :].expand(b, num_layers, num_kv_heads, -1).gather(-1, indices)  # (b, L, H, keep)
        srcs.append(src.permute(1, 2, 0, 3).reshape(num_layers, num_kv_heads, b * keep))
        dsts.append(slots[:, :keep].reshape(-1))
    src = srcs[0] if len(srcs) == 1 else torch.cat(srcs, dim=-1)  # (layers, H_kv, T): per head, where entry t comes from
    dst = dsts[0] if len(dsts) == 1 else torch.cat(dsts)  # (T,): where entry t goes
    heads = torch.arange(num_kv_heads, device=dst.device)[:, None]
    for layer in range(num_layers):
        # A quantized pool's codes (S, H_kv, D) and scales (S, H_kv) move with the same indices.
        for part in entry_parts(k_buffers[layer]) + entry_parts(v_buffers[layer]):
            gathered = part[src[layer], heads]  # (H_kv, T[, D]), a copy, so the in-place write below is safe
            part[dst] = gathered.transpose(0, 1)


@torch.inference_mode()
def compact_batch(cfg: KVPolicyConfig, ring: QueryRing, due: list[DueRequest], k_buffers: list[Tensor],
                  v_buffers: list[Tensor]) -> list[Tensor]:
    """Compact every request in `due` in place, as `compact_entries` would one by one, with the keep-sets it would
    choose: scoring and selection per chunk of same-shape requests (`batch_chunks`, `select_batch`), then the moves
    of all of them together (`move_entries`). Returns each request's new kept positions, also in its state."""
    if not due:
        return []
    kept: list[Tensor | None] = [None] * len(due)
    moves = []
    for members in batch_chunks(due, ring.window, k_buffers[0].shape[1]):
        chunk = [due[i] for i in members]
        indices, positions = select_batch(cfg, ring, chunk, k_buffers)
        moves.append((torch.stack([d.slots for d in chunk]), indices))
        for j, i in enumerate(members):
            kept[i] = positions[j]
    move_entries(moves, k_buffers, v_buffers)
    for d, positions in zip(due, kept):
        d.state.kept_positions = positions
        d.state.appended_from = d.cached
    return kept


def compact_entries(cfg: KVPolicyConfig, state: CompactionState, ring: QueryRing, row: int, slots: Tensor,
                    k_buffers: list[Tensor], v_buffers: list[Tensor], keep: int, cached: int) -> Tensor:
    """Compact the request held in `slots` (n,) to `keep` entries per layer and KV head, in place (`compact_batch`
    with a batch of one).

    Head h of layer l ends with its j-th kept entry in `slots[j]`; the slots of entries keep..n-1 hold nothing
    the request needs any more (the caller frees them). `cached`: the request's logical length, where the
    entries appended from now on start. Returns the new kept positions, (layers, H_kv, keep), also in `state`.
    """
    return compact_batch(cfg, ring, [DueRequest(state, row, slots, keep, cached)], k_buffers, v_buffers)[0]
