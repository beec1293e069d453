"""The `sparserl_kv` attention backend: SGLang's own backend plus KV compression that frees what it evicts.

Loaded in every SGLang process through the `sglang.srt.plugins` entry point `sparserl_kv` (setup.py), and
active only where the engine set `SPARSERL_SGLANG_KV` (a JSON of the policy, the base backend and the trace
flag; spawned processes inherit it). `register()` then

1. registers the backend name `sparserl_kv` (and adds it to SGLang's argument choices). Its factory builds the
   base backend (`torch_native` on CPU; triton / flashinfer / fa3 on GPU) and puts query capture and logical
   decode positions in front of its `forward` / `init_forward_metadata` / `init_forward_metadata_out_graph` /
   `init_cuda_graph_state` (`_wrap`): the instance keeps its class, so every other method, and SGLang's checks
   on the instance, stay the base backend's.
2. hooks three scheduler methods through SGLang's `HookRegistry` (the plugin mechanism of 0.5.23):
   - `Scheduler.process_batch_result` (around): before it, each sampled row gets its per-token record in
     `logits_output.customized_info["sparserl_kv"]` (entries held during the forward, running requests,
     compactions since the last token), which SGLang streams to `meta_info`; after it, every request that
     sampled a token steps its `CompressionSchedule`, and a due request is compacted: its KV per layer and
     KV head moved into its first `keep` slots, the rest freed to SGLang's allocator, its row, `kv_committed_len`
     / `kv_allocated_len` and the batch's `seq_lens` shortened, so the next admission sees the slots free.
   - `Scheduler.get_new_batch_prefill` (around): admission counts each request's remaining need as its
     compression bound (`CompressionSchedule.max_slots` minus what it holds) instead of its dense length,
     by presenting a smaller `max_new_tokens` to SGLang's `PrefillAdder` for the duration of the call only.
   - `SchedulerInternalStateController.get_internal_state` (after): adds the pool counters (free slots, size,
     high-water, most requests running, compactions, query-ring bytes) under "sparserl_kv", read by the engine
     after a generate.
   - `SchedulerWeightUpdaterManager.release_memory_occupation` (after): when the KV cache is released (the
     engine sleeps), the compactor's query ring goes with it.

Positions: the backend shifts decode positions to logical ones (RoPE), and the same tensor is on the batch's
`sampling_info` for the sampler (sampler_plugin.py), whose noise is keyed by the position: SGLang 0.5.23's
runner gives the backend and the model a copy of the forward batch, and the sampler the original. Host syncs:
none in the bookkeeping (the batch's rows come from the scheduler's requests, `Scheduler.run_batch` (around),
and compaction offsets are mirrored on the host); tracing adds the copies of what it reports.

CUDA graphs (decode): a decode forward's capture index and position offsets live in static buffers
(kv_decode.py), written in place from the host's bookkeeping before the forward, eagerly or before a replay
(`init_forward_metadata_out_graph`); the query capture inside the forward indexes the ring with them, so the
captured kernels read this step's values. Padding rows go to the ring's spare row. Prefill stays eager.

Why these pieces and not the backend alone: a backend sees one forward at a time and no `Req` objects, and
freeing slots needs the request's KV record and the batch's lengths, which only the scheduler owns; admission
reads `max_new_tokens` in several places of `PrefillAdder`. Pinned to SGLang 0.5.23 (docs/decisions.md).

Requirements, set by the engine (`SGLangOptions.server_args`): radix cache off (compaction edits and frees
slots a prefix tree would share), overlap scheduling off (the scheduler must see a step's tokens before the
next step is prepared), page size 1, no mixed chunked prefill, no prefill CUDA graphs (a prefill's capture
index is planned per forward; decode graphs are fine).
Left out on purpose: speculative decoding, hybrid (SWA / Mamba) pools, data-parallel attention, and TP ranks
agreeing on share=layer/all selections (share=head is rank-local).
"""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext

import torch
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sparserl.kv import KVPolicyConfig, NewlineTokens
from sparserl.kv.schedule import CompressionSchedule
from sparserl.engines.sglang.kv_compactor import KVCompactor, RequestKV
from sparserl.engines.sglang.kv_decode import DecodeBuffers
from sparserl.engines.sglang.sampler_plugin import DRAWN_POSITIONS, LOGICAL_POSITIONS
from sparserl.utils.host_syncs import HostSyncs

BACKEND_NAME = "sparserl_kv"
ENV = "SPARSERL_SGLANG_KV"
RECORD_KEY = "sparserl_kv"
logger = logging.getLogger(__name__)

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
_WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"


class KVRuntime:
    """The one compression runtime of a scheduler process: made by the backend factory, read by the hooks."""

    def __init__(self, cfg: KVPolicyConfig, runner, trace: bool, count_syncs: bool = False) -> None:
        self.cfg = cfg
        self.trace = trace
        # Host syncs of the bookkeeping (before_forward, after_step), counted where the engine asks for it.
        self.syncs = HostSyncs() if count_syncs else None
        self.decode_forwards = 0
        self.batch_rows: list[int] | None = None  # the next forward's req_to_token rows, set by _around_run_batch
        self.kv_pool = runner.token_to_kv_pool
        self.req_to_token = runner.req_to_token_pool.req_to_token  # (rows, context) int32
        self.allocator = runner.token_to_kv_pool_allocator
        self.layer_ids = list(range(self.kv_pool.start_layer, self.kv_pool.start_layer + self.kv_pool.layer_num))
        num_kv_heads = self.kv_pool.get_key_buffer(self.layer_ids[0]).shape[1]
        self.compactor = KVCompactor(cfg, len(self.layer_ids), num_kv_heads, self.req_to_token.shape[0], runner.device)
        # Static decode state (capture index, position shift); grown for CUDA graphs by `init_cuda_graph_state`.
        self.decode = DecodeBuffers(self.req_to_token.shape[0], runner.device)
        self.graphs = False  # CUDA graphs captured: the query ring then stays allocated (graphs hold its address)
        self._newline = NewlineTokens(cfg.divide_method)
        self.high_water = 0
        self.peak_running = 0
        self.compressions = 0
        self.compress_s = 0.0

    # ------------------------------------------------------------ forward side (the backend)
    def before_forward(self, fb) -> None:
        with self.syncs if self.syncs is not None else nullcontext():
            self._before_forward(fb)

    def _before_forward(self, fb) -> None:
        mode = fb.forward_mode
        if mode.is_idle() or getattr(fb, "_sparserl_kv_planned", False):  # planned once per forward batch
            return
        fb._sparserl_kv_planned = True
        # The rows on the host, from the scheduler's requests (`_around_run_batch`): no device read.
        rows, self.batch_rows = self.batch_rows, None
        if rows is None or len(rows) != fb.batch_size:
            rows = fb.req_pool_indices.tolist()  # a forward that did not come through Scheduler.run_batch
        if mode.is_decode():
            # Logical positions for RoPE here, and for the sampler's noise keys: in 0.5.23 the runner hands the
            # backend a copy of the batch (`EagerRunner.load_batch` -> `dataclasses.replace`) while the sampler
            # reads the original's positions, so they travel on the `sampling_info` both share (`_around_run_batch`
            # puts the same static buffer there, for graph replays, where no sampling_info reaches the backend).
            logical = self._plan_decode(rows, fb.batch_size, fb.positions)
            fb.positions = logical if logical.dtype == fb.positions.dtype else logical.to(fb.positions.dtype)
            setattr(fb.sampling_info, LOGICAL_POSITIONS, logical)
        elif mode.is_extend() and not mode.is_mixed():
            prefix = fb.extend_prefix_lens_cpu
            self.compactor.plan_capture(rows, list(fb.extend_seq_lens_cpu), [p == 0 for p in prefix])
            setattr(fb.sampling_info, LOGICAL_POSITIONS, None)  # a prefill samples at its own (logical) length
        else:
            raise RuntimeError(f"{BACKEND_NAME}: forward mode {mode} is not supported (mixed chunked prefill and "
                               "speculative decoding must be off)")

    def before_graph(self, fb, in_capture: bool) -> None:
        """Before a decode graph is captured or replayed (SGLang's `init_forward_metadata_out_graph`): the same
        static state as an eager decode forward, padding rows included; positions are shifted in the graph's own
        input buffer. A capture's dummy batch is all padding and touches no request's state."""
        if getattr(fb, "_sparserl_kv_planned", False):  # the eager path, through the base's init_forward_metadata
            return
        if not fb.forward_mode.is_decode():
            raise RuntimeError(f"{BACKEND_NAME}: CUDA graphs of forward mode {fb.forward_mode} are not supported "
                               "(decode graphs only; prefill CUDA graphs must be off)")
        actual = getattr(fb, "actual_forward_mode", fb.forward_mode)
        if in_capture or actual.is_idle():
            self.decode.write([], [], [], fb.batch_size, self.compactor.ring.spare_row)
            return
        with self.syncs if self.syncs is not None else nullcontext():
            raw = fb.batch_size - (getattr(fb, "num_padding", 0) or 0)
            rows, self.batch_rows = self.batch_rows, None
            if rows is None or len(rows) != raw:
                rows = fb.req_pool_indices[:raw].tolist()  # a forward that did not come through Scheduler.run_batch
            positions = fb.positions[:raw]
            positions.copy_(self._plan_decode(rows, fb.batch_size, positions))

    def _plan_decode(self, rows: list[int], padded: int, positions: torch.Tensor) -> torch.Tensor:
        """One query per row into the ring (each row's next window place, counted in its state, as
        `QueryRing.plan` places one token) and the rows' offsets, written to the static buffers; returns the
        logical positions (a view of the static buffer)."""
        self.decode_forwards += 1
        window = self.compactor.window
        places = []
        for row in rows:
            st = self.compactor.state.setdefault(row, RequestKV())
            places.append(st.queries_seen % window if window else 0)
            st.queries_seen += 1
        offsets = [self.compactor.offset[r] for r in rows]
        self.decode.write(rows, places, offsets, padded, self.compactor.ring.spare_row)
        return self.decode.shift(positions)

    def capture(self, layer, q: torch.Tensor, decode: bool = False) -> None:
        local = layer.layer_id - self.kv_pool.start_layer
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if not decode:
            self.compactor.capture(local, q)
        elif self.compactor.window:  # static index: the same kernels eagerly and inside a CUDA graph
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and not self.compactor.ring.allocated:
                raise RuntimeError(f"{BACKEND_NAME}: the query ring must exist before a CUDA graph is captured "
                                   "(SGLang's warm-up forwards allocate it)")
            rows, places = self.decode.capture_index(q.shape[0])
            self.compactor.ring.capture_rows(local, q, rows, places)

    # ------------------------------------------------------------ scheduler side (the hooks)
    def records(self, batch) -> list:
        """Per row of a batch about to be processed: [entries held in the forward, running requests, compactions
        since the previous token as (tokens before it, seconds, kept positions or None), the position the token's
        noise was keyed by (traced engines only, else None)]."""
        held = batch.seq_lens_cpu.tolist()
        running = len(batch.reqs)
        used = self.allocator.size - self.allocator.available_size()
        self.high_water = max(self.high_water, used)
        self.peak_running = max(self.peak_running, running)
        drawn = getattr(batch.sampling_info, DRAWN_POSITIONS, None) if self.trace else None
        drawn = drawn.tolist() if drawn is not None and len(drawn) == len(batch.reqs) else [None] * len(batch.reqs)
        return [[h, running, self.compactor.take_events(req.kv.req_pool_idx) if req.kv.holds_kv else [], d]
                for req, h, d in zip(batch.reqs, held, drawn)]

    def after_step(self, scheduler, batch) -> None:
        """Step the schedule of every request that sampled a token; compact the due ones and free their slots."""
        with self.syncs if self.syncs is not None else nullcontext():
            self._after_step(scheduler, batch)

    def _after_step(self, scheduler, batch) -> None:
        due = []  # (batch index, request, row, entries held)
        for i, req in enumerate(batch.reqs):
            if req.finished() or req.is_retracted or not req.kv.holds_kv or not req.output_ids:
                continue
            row = req.kv.req_pool_idx
            held = req.kv.kv_committed_len
            st = self.compactor.state.get(row)
            if st is not None and st.outputs_seen >= len(req.output_ids):
                continue  # no new token for this request (a chunk of its prefill)
            if self.compactor.on_token(row, req.rid, len(req.origin_input_ids), len(req.output_ids), held,
                                       self._is_newline(scheduler, req.output_ids[-1])):
                due.append((i, req, row, held))
        if due:
            self._compact(batch, due)

    def _compact(self, batch, due: list) -> None:
        """Compact every request due at this step in one batched pass (`KVCompactor.compact_many`), then free each
        one's slots and shorten its row and the batch's lengths."""
        t0 = time.perf_counter()
        work = []
        for _, req, row, n in due:
            assert req.kv.kv_allocated_len == n and req.kv.cache_protected_len == 0, (
                f"request {req.rid}: kv_committed_len={n}, kv_allocated_len={req.kv.kv_allocated_len}, "
                f"cache_protected_len={req.kv.cache_protected_len}: compaction needs a private, fully committed row")
            work.append((row, self.req_to_token[row, :n].long(), len(req.output_ids)))
        keys = [self.kv_pool.get_key_buffer(layer) for layer in self.layer_ids]
        values = [self.kv_pool.get_value_buffer(layer) for layer in self.layer_ids]
        done = self.compactor.compact_many(work, keys, values, self.trace)
        for (i, req, row, n), result in zip(due, done):
            keep = result.keep
            self.allocator.free(result.freed)
            self.req_to_token[row, keep:n] = 0
            req.kv.kv_committed_len = req.kv.kv_allocated_len = keep
            freed = n - keep
            batch.seq_lens[i] -= freed
            batch.seq_lens_cpu[i] -= freed
            if getattr(batch, "orig_seq_lens", None) is not None:
                batch.orig_seq_lens[i] -= freed
            if batch.seq_lens_sum is not None:
                batch.seq_lens_sum -= freed
        self.compressions += len(due)
        self.compress_s += time.perf_counter() - t0

    def _is_newline(self, scheduler, token: int) -> bool:
        return self._newline(token, scheduler.tokenizer)

    def admission_bound(self, req, held: int) -> int:
        """`max_new_tokens` that makes SGLang's admission reserve this request's compression bound."""
        p = req.sampling_params
        out = len(req.output_ids)
        bound = CompressionSchedule.max_slots(self.cfg, len(req.origin_input_ids), p.max_new_tokens)
        return min(p.max_new_tokens, out + max(1, bound - held))

    def counters(self) -> dict:
        out = {"pool_size": int(self.allocator.size), "pool_free": int(self.allocator.available_size()),
               "high_water": self.high_water, "peak_running": self.peak_running,
               "compressions": self.compressions, "compress_s": self.compress_s,
               "query_buffer_bytes": self.compactor.buffer_bytes()}
        if self.syncs is not None:
            out["host_syncs"], out["decode_forwards"] = self.syncs.count, self.decode_forwards
            self.syncs.events.clear()
            self.decode_forwards = 0
        self.high_water = self.allocator.size - self.allocator.available_size()
        self.peak_running = 0
        return out


_RUNTIME: KVRuntime | None = None  # set once, by the backend factory of this scheduler process


def _wrap(backend) -> None:
    """Query capture and logical decode positions in front of the base backend's own methods, as instance
    attributes: the instance keeps its class, so SGLang's checks on it (and every other method) are the base's.
    Eager forwards come through `init_forward_metadata`; CUDA-graph captures and replays through
    `init_forward_metadata_out_graph` (SGLang 0.5.23's hook outside the graph; the legacy capture / replay hooks
    are gone from its base class), which update the static decode state and then run the base's; the base's
    `init_forward_metadata_in_graph` has nothing of ours to add and stays as it is."""
    base_init, base_forward = backend.init_forward_metadata, backend.forward
    base_out_graph, base_graph_state = backend.init_forward_metadata_out_graph, backend.init_cuda_graph_state

    def init_forward_metadata(forward_batch):
        _RUNTIME.before_forward(forward_batch)
        base_init(forward_batch)

    def init_forward_metadata_out_graph(forward_batch, in_capture=False):
        _RUNTIME.before_graph(forward_batch, in_capture)
        base_out_graph(forward_batch, in_capture)

    def init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs):
        _RUNTIME.decode.grow(max(max_bs, max_num_tokens))
        _RUNTIME.graphs = True
        base_graph_state(max_bs, max_num_tokens, *args, **kwargs)

    def forward(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        mode = forward_batch.forward_mode
        if not mode.is_idle():
            _RUNTIME.capture(layer, q, decode=mode.is_decode())
        return base_forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    backend.init_forward_metadata, backend.forward = init_forward_metadata, forward
    backend.init_forward_metadata_out_graph, backend.init_cuda_graph_state = init_forward_metadata_out_graph, \
        init_cuda_graph_state


def settings() -> dict:
    return json.loads(os.environ[ENV])


def create_backend(runner):
    global _RUNTIME
    s = settings()
    base_name = s["base"]
    if base_name == BACKEND_NAME or base_name not in ATTENTION_BACKENDS:
        raise ValueError(f"{BACKEND_NAME}: base attention backend {base_name!r} is not one of SGLang's")
    if any(f"{_SCHEDULER}.{m}" not in HookRegistry._patched for m in ("process_batch_result", "get_new_batch_prefill", "run_batch")):
        raise RuntimeError(f"{BACKEND_NAME}: the scheduler hooks were not applied in this process; without them "
                           "evicted slots would never be freed")
    backend = ATTENTION_BACKENDS[base_name](runner)
    _wrap(backend)
    _RUNTIME = KVRuntime(KVPolicyConfig(**s["policy"]), runner, bool(s.get("trace")), bool(s.get("count_syncs")))
    return backend


# ------------------------------------------------------------------ scheduler hooks
def _around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    rt = _RUNTIME
    mode = batch.forward_mode
    if rt is None or not (mode.is_decode() or mode.is_extend()):
        return original(scheduler, batch, result, *args, **kwargs)
    logits_output = getattr(result, "logits_output", None)
    if logits_output is not None:
        info = dict(logits_output.customized_info or {})
        info[RECORD_KEY] = rt.records(batch)
        logits_output.customized_info = info
    out = original(scheduler, batch, result, *args, **kwargs)
    rt.after_step(scheduler, batch)
    return out


def _around_run_batch(original, scheduler, batch, *args, **kwargs):
    rt = _RUNTIME
    if rt is not None and batch is not None and batch.reqs:
        rt.batch_rows = [req.kv.req_pool_idx for req in batch.reqs]  # the order of batch.req_pool_indices
        if batch.sampling_info is not None and batch.forward_mode.is_decode():
            # The sampler's noise positions: the static buffer this forward's logical positions are written to
            # (eagerly or before a graph replay). Overlap scheduling is off, so the forward shares this object.
            setattr(batch.sampling_info, LOGICAL_POSITIONS, rt.decode.logical[:len(batch.reqs)])
    return original(scheduler, batch, *args, **kwargs)


def _around_get_new_batch_prefill(original, scheduler, running_batch, *args, **kwargs):
    rt = _RUNTIME
    if rt is None:
        return original(scheduler, running_batch, *args, **kwargs)
    saved = []
    running = running_batch.reqs if running_batch is not None else []
    for req, held in [(r, r.kv.kv_allocated_len) for r in running] + \
                     [(r, len(r.origin_input_ids) + len(r.output_ids)) for r in scheduler.waiting_queue]:
        saved.append((req.sampling_params, req.sampling_params.max_new_tokens))
        req.sampling_params.max_new_tokens = rt.admission_bound(req, held)
    try:
        return original(scheduler, running_batch, *args, **kwargs)
    finally:
        for params, value in saved:
            params.max_new_tokens = value


def _after_get_internal_state(result, *args, **kwargs):
    if _RUNTIME is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state[RECORD_KEY] = _RUNTIME.counters()
    return result


def _after_release_memory_occupation(result, manager, recv_req, *args, **kwargs):
    """The engine sleeps: with the KV cache, drop the compactor's query ring (allocated outside SGLang's memory
    accounting, (rows, window, H_q, D) per layer); the next forward allocates it again."""
    tags = getattr(recv_req, "tags", None)
    if _RUNTIME is not None and not _RUNTIME.graphs and (not tags or "kv_cache" in tags):
        _RUNTIME.compactor.release()  # kept under CUDA graphs, which write it at the address they captured
    return result


def register() -> None:
    """The `sglang.srt.plugins` entry point: in engines started with compression, register the backend and the
    scheduler hooks; elsewhere nothing changes."""
    if ENV not in os.environ or BACKEND_NAME in ATTENTION_BACKENDS:  # plugins may load twice
        return
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_backend)
    HookRegistry.register(f"{_SCHEDULER}.process_batch_result", _around_process_batch_result, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.get_new_batch_prefill", _around_get_new_batch_prefill, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.run_batch", _around_run_batch, HookType.AROUND)
    HookRegistry.register(f"{_INTERNAL_STATE}.get_internal_state", _after_get_internal_state, HookType.AFTER)
    HookRegistry.register(f"{_WEIGHT_UPDATER}.release_memory_occupation", _after_release_memory_occupation,
                          HookType.AFTER)
