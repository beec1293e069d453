"""Decode-only steps over static buffers, captured as CUDA graphs on CUDA (`rollout.cuda_graphs`).

A step that only decodes (no prefill, no forks) has the same shape as the one before it up to the batch size, so
`StaticDecode` runs it over buffers allocated once, padded to a batch-size bucket (`bucket_sizes`): on CUDA the
forward of each bucket is captured once with `torch.cuda.CUDAGraph` and replayed; elsewhere the very same code runs
eagerly (the CPU tests check it against the eager engine). Prefill, mixed steps, forks and compaction stay eager
(`runner.py`, `compressor.py`).

The buffers (made outside inference mode, so that any grad mode may write them):
- a staging block of int64 (fields x bucket): input ids, positions, write slots, lengths, table rows, query-ring
  rows and places. The host fills a pinned copy through numpy views and ONE non-blocking copy moves it to the device;
- the slot table (max_num_seqs + 1 rows x W), W the largest reservation seen, rounded up (growing it recaptures).
  A sequence keeps its row for life; its entries reach the table through a pinned host mirror (written with numpy,
  copied per row, non-blocking) when it takes its row, after a compaction (`slots_version`) or after eager steps,
  and the step itself appends the entry it writes (inside the graph). Entries no sequence wrote hold slot 0 (the
  runner zeroes it, as for the eager path's padded gathers). The last row is the padding rows' row: length 0; they
  write their K/V into the sink, the pool's extra slot that the `SlotPool` never hands out and nothing reads;
- the rows' sampling settings (seed, top-k; temperature, top-p), written when a sequence takes its row;
- pinned host buffers for the sampled tokens and their log-probs.

Host syncs per step: one, the event after the sampled tokens' non-blocking copy (counted in `waits`: CUDA's sync
detector does not see an event wait). The draw (`engines/draw.py`) runs after the replay, eagerly, on the first n
rows of the bucket, its flags from the requests' Python parameters. The step runs with the engine's device current
(`torch.cuda.device`), so the event, the side stream and the capture are on it whichever device the process has
current. Captured graphs are dropped (and re-captured on the next decode, counted in `captures`, their time in
`capture_s`) when the pool, the weights, the query ring or W change; sleep drops the pool, so every training step
captures again (the pool's memory is freed and allocated anew, at other addresses).
Models whose forward reads a device value on the host cannot be captured: RoPE types that choose their
frequencies from the largest position (transformers' dynamic and longrope scaling), see `capture_blocker`; for them
`resolve_cuda_graphs` turns the static step off and says so once.
Left out on purpose: capturing the draw (its flags pick the kernels), prefill in graphs, keeping graphs across sleep.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from sparserl.engines.draw import RowSettings, sample
from sparserl.engines.native.sequence import Sequence
from sparserl.engines.native.static_attention import StaticDecodeAttention
from sparserl.model.attention import ForwardContext, forward_context

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
WIDTH_STEP = 512  # the table's width grows in multiples of this
IDS, POS, WRITE, LEN, ROW, RING_ROW, RING_PLACE = range(7)
FIELDS = 7


def resolve_cuda_graphs(setting: str | bool, device: torch.device, model: torch.nn.Module | None = None) -> bool:
    """`rollout.cuda_graphs`: on | off | auto (on for CUDA engines). On elsewhere runs the static step eagerly.
    Off, with one log line, for a `model` whose forward cannot be captured (`capture_blocker`)."""
    if isinstance(setting, bool):
        on = setting
    elif setting not in ("auto", "on", "off"):
        raise ValueError(f"rollout.cuda_graphs must be auto, on or off, not {setting!r}")
    else:
        on = setting == "on" or (setting == "auto" and device.type == "cuda")
    blocker = capture_blocker(model) if on and model is not None else None
    if blocker is not None:
        log.warning("rollout.cuda_graphs=%s: decode steps run eagerly, %s", setting, blocker)
        return False
    return on


def capture_blocker(model: torch.nn.Module) -> str | None:
    """Why the model's decode forward cannot be captured, or None. Transformers' `dynamic_rope_update` makes the
    dynamic and longrope RoPE types read `torch.max(position_ids)` on the host in every forward (to pick or grow
    their frequencies), which a CUDA graph cannot replay."""
    for name, module in model.named_modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]  # a rope type per layer type
        for kind in kinds:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return (f"the model's RoPE ({name or 'model'}.rope_type={kind!r}) reads the largest position on the "
                        "host in every forward")
    return None


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes, the last one `max_num_seqs` (past 256: every 64 rows)."""
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    sizes += list(range(320, max_num_seqs, 64))
    return sizes + [max_num_seqs]


class StaticDecode:
    def __init__(self, runner, max_num_seqs: int, capture: bool) -> None:
        self.runner = runner
        self.device = runner.device
        self.capture = capture  # CUDA graphs; False runs the same step eagerly
        self.trim = not capture  # eager runs attend only as wide as the step's longest row, not the whole table
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_rows = max_num_seqs
        self.attention = StaticDecodeAttention(self.device, runner.head_dim)
        self.captures = 0  # graphs captured over the engine's life
        self.capture_s = 0.0  # seconds spent capturing them (warm-up forward included)
        self.waits = 0  # event waits: the step's one host sync each, on CUDA
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # the graphs' shared memory pool
        self._key = None  # (W, the query ring's buffers) the graphs were captured with
        self.event = torch.cuda.Event() if self.device.type == "cuda" else None
        self.release()

    # ------------------------------------------------------------------ lifecycle
    def release(self) -> None:
        """Drop the buffers and the graphs (the pool goes away: the engine sleeps)."""
        self.invalidate()
        self.rows: dict[int, list[int]] = {}  # seq_id -> [row, entries in the table, slots_version]
        self._free_rows = list(range(self.max_rows - 1, -1, -1))
        self.width = 0
        self.table = self.host_table = None
        self.dev_in = self.host_in = None

    def invalidate(self) -> None:
        """Drop the captured graphs (the weights or the pool moved); the next decode captures again."""
        self.graphs.clear()
        self._pool = None
        self._key = None

    def forget(self, seq: Sequence) -> None:
        entry = self.rows.pop(seq.seq_id, None)
        if entry is not None:
            self._free_rows.append(entry[0])

    @property
    def sink(self) -> int:
        return self.runner.num_slots  # the pool's extra slot (runner.allocate)

    def _allocate(self) -> None:
        pin = self.device.type == "cuda"
        rows, n = self.max_rows + 1, FIELDS * self.sizes[-1]
        with torch.inference_mode(False):
            self.host_in = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
            self.dev_in = torch.zeros(n, dtype=torch.int64, device=self.device)
            self.host_isets = torch.zeros((2, rows), dtype=torch.int64, pin_memory=pin)  # seed, top-k
            self.host_fsets = torch.zeros((2, rows), dtype=torch.float32, pin_memory=pin)  # temperature, top-p
            self.isets = torch.zeros((2, rows), dtype=torch.int64, device=self.device)
            self.fsets = torch.zeros((2, rows), dtype=torch.float32, device=self.device)
            self.host_tokens = torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=pin)
            self.host_logps = torch.zeros(self.sizes[-1], dtype=torch.float32, pin_memory=pin)
            self.no_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.np_in, self.np_isets, self.np_fsets = self.host_in.numpy(), self.host_isets.numpy(), self.host_fsets.numpy()
        self.np_tokens, self.np_logps = self.host_tokens.numpy(), self.host_logps.numpy()
        self._settings_dirty = False

    def _ensure_width(self, need: int) -> None:
        """A table at least `need` wide (a wider one keeps the rows' entries and drops the graphs)."""
        if need <= self.width:
            return
        width = -(-need // WIDTH_STEP) * WIDTH_STEP
        pin = self.device.type == "cuda"
        with torch.inference_mode(False):
            table = torch.zeros((self.max_rows + 1, width), dtype=torch.int32, device=self.device)
            host = torch.zeros((self.max_rows + 1, width), dtype=torch.int32, pin_memory=pin)
        if self.table is not None:
            table[:, : self.width].copy_(self.table)
            host[:, : self.width].copy_(self.host_table)
        self.table, self.host_table, self.np_table, self.width = table, host, host.numpy(), width
        self.invalidate()

    # ------------------------------------------------------------------ one step
    def step(self, seqs: list[Sequence], sampler, compressor=None) -> tuple[list[int], list[float]]:
        """Decode one token for each of `seqs` (each has its new slot as `slots[-1]`) and count it in `num_cached`;
        returns the sampled tokens and their log-probs. `compressor`: the engine's, when queries are kept for KV
        compression."""
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            return self._step(seqs, sampler, compressor)

    def _step(self, seqs: list[Sequence], sampler, compressor) -> tuple[list[int], list[float]]:
        if self.dev_in is None:
            self._allocate()
        self._ensure_width(max(max(s.reserve, len(s.slots)) for s in seqs))
        ring = compressor.ring if compressor is not None else None
        self._check_key(ring)
        self._sync_rows(seqs, sampler)
        n = len(seqs)
        size = next(b for b in self.sizes if b >= n)
        self._stage(seqs, size, compressor)
        for seq in seqs:
            seq.num_cached += 1
        logits = self._run(size, max(len(s.slots) for s in seqs), ring)
        return self._draw(logits, seqs, size)

    def _check_key(self, ring) -> None:
        if ring is not None and self.capture and not ring.allocated:
            text = self.runner.model.config
            text = text.get_text_config() if hasattr(text, "get_text_config") else text
            ring.allocate(text.num_attention_heads, self.runner.head_dim, self.runner.dtype, self.device)
        key = (self.width, None if ring is None or not ring.allocated else tuple(b.data_ptr() for b in ring.buffers))
        if key != self._key:
            self.invalidate()
            self._key = key

    def _sync_rows(self, seqs: list[Sequence], sampler) -> None:
        """Give new sequences a row and their settings; bring every row's table up to all but its newest entry
        (the step appends that one)."""
        for seq in seqs:
            entry = self.rows.get(seq.seq_id)
            if entry is None:
                entry = self.rows[seq.seq_id] = [self._free_rows.pop(), 0, seq.slots_version]
                self._write_settings(entry[0], seq, sampler)
            row, synced = entry[0], entry[1]
            if entry[2] != seq.slots_version:
                synced, entry[2] = 0, seq.slots_version
            end = len(seq.slots) - 1
            if synced < end:
                self.np_table[row, synced:end] = seq.slots[synced:end]
                self.table[row, synced:end].copy_(self.host_table[row, synced:end], non_blocking=True)
            entry[1] = end + 1
        if self._settings_dirty:
            self.isets.copy_(self.host_isets, non_blocking=True)
            self.fsets.copy_(self.host_fsets, non_blocking=True)
            self._settings_dirty = False

    def _write_settings(self, row: int, seq: Sequence, sampler) -> None:
        p = seq.params
        self.np_isets[0, row], self.np_isets[1, row] = sampler.seed_of(seq), p.top_k
        self.np_fsets[0, row], self.np_fsets[1, row] = p.temperature, p.top_p
        self._settings_dirty = True

    def _stage(self, seqs: list[Sequence], size: int, compressor) -> None:
        n = len(seqs)
        st = self.np_in[: FIELDS * size].reshape(FIELDS, size)
        st[:, n:] = 0
        st[WRITE, n:] = self.sink
        st[ROW, n:] = self.max_rows  # the padding row
        st[IDS, :n] = [s.output[-1] for s in seqs]  # a decoding sequence feeds back its last sample
        st[POS, :n] = [s.num_cached for s in seqs]
        st[WRITE, :n] = [s.slots[-1] for s in seqs]
        st[LEN, :n] = [len(s.slots) for s in seqs]
        st[ROW, :n] = [self.rows[s.seq_id][0] for s in seqs]
        if compressor is not None:
            st[RING_ROW, :n], st[RING_PLACE, :n] = compressor.decode_places(seqs)
            st[RING_ROW, n:] = compressor.ring.spare_row
        self.dev_in[: FIELDS * size].copy_(self.host_in[: FIELDS * size], non_blocking=True)

    def _run(self, size: int, longest: int, ring) -> torch.Tensor:
        if not self.capture:
            prepacker = self.runner.prepacker
            if prepacker is not None:
                prepacker.prepare(size)
            try:
                return self._forward(size, longest if self.trim else self.width, ring)
            finally:
                if prepacker is not None:
                    prepacker.disarm()
        graph = self.graphs.get(size)
        if graph is None:
            t0 = time.perf_counter()
            graph = self.graphs[size] = self._capture(size, ring)
            self.capture_s += time.perf_counter() - t0  # the capture synchronizes: the warm-up has run by now
        graph[0].replay()
        return graph[1]

    def _capture(self, size: int, ring) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # One run first, on a side stream (kernels compiled, workspaces made): it writes what the replay writes again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(size, self.width, ring)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size, self.width, ring)
        self.captures += 1
        log.debug("captured the decode step for batch size %d (table width %d, capture %d)", size, self.width,
                  self.captures)
        return graph, logits

    def _forward(self, size: int, width: int, ring) -> torch.Tensor:
        """The captured body: append this step's entries, gather the rows' table, run the model on the buffers;
        returns float32 logits (size, V)."""
        v = self.dev_in[: FIELDS * size].view(FIELDS, size)
        write, lengths, rows = v[WRITE], v[LEN], v[ROW]
        # A padding row (length 0) appends its sink slot to the last column of the padding row, which nothing reads.
        self.table.index_put_((rows, (lengths - 1).remainder(self.width)), write.to(torch.int32))
        table = self.table[:, :width].index_select(0, rows)  # (size, width)
        r = self.runner
        self.attention.prepare(table, lengths, r.dtype)
        on_queries = None
        if ring is not None:
            ring_rows, places = v[RING_ROW], v[RING_PLACE]
            on_queries = lambda layer, q: ring.capture_rows(layer, q, ring_rows, places)  # noqa: E731
        ctx = ForwardContext(n_decode=size, write_slots=write, k_cache=r.k_cache, v_cache=r.v_cache,
                             decode_cache=self.attention, on_queries=on_queries)
        # A 4-D mask is passed through by transformers' mask builders untouched (no look at the positions on the
        # host); the packed attention ignores it.
        with forward_context(ctx):
            out = r.model(input_ids=v[IDS][None], position_ids=v[POS][None], attention_mask=self.no_mask,
                          use_cache=False, logits_to_keep=0)
        return out.logits[0].float()

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], size: int) -> tuple[list[int], list[float]]:
        n = len(seqs)
        v = self.dev_in[: FIELDS * size].view(FIELDS, size)
        rows = v[ROW, :n]
        params = [s.params for s in seqs]
        settings = RowSettings.from_tensors(
            self.fsets[0].index_select(0, rows), self.fsets[1].index_select(0, rows),
            self.isets[1].index_select(0, rows), self.isets[0].index_select(0, rows),
            [p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params])
        tokens, logp = sample(logits[:n], settings, v[POS, :n])  # positions: of the tokens fed in
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        self.host_tokens[:n].copy_(tokens, non_blocking=True)
        self.host_logps[:n].copy_(chosen, non_blocking=True)
        if self.event is not None:
            self.event.record()
            self.event.synchronize()  # the step's one wait
            self.waits += 1
        return self.np_tokens[:n].tolist(), self.np_logps[:n].tolist()
