"""The native rollout engine: continuous batching over a KV slot pool, on the Hugging Face model's modules.

`generate` admits requests while their current KV need fits the pool (`admission=optimistic`, retracting the
youngest sequences when the running ones outgrow it, scheduler.py) or their worst case does (`reserve`), runs one
packed forward per step (prefill of new sequences and one decode token of every running one), samples with the
keyed draw shared with SGLang (engines/draw.py), and retires sequences on a stop token, a stop string or
`max_new_tokens`, freeing their slots for the next waiting ones. Left out on purpose: an async/streaming API (the trainer wants whole batches),
prefix caching across prompts (the `n` samples of one prompt do share its prefill), speculative decoding.
With `quantization` the linear layers hold int8 / fp8 weights, re-quantized at every weight update
(`quantize.py`); `rescore_seqs` re-scores a few sequences densely to split the mismatch (`rescore.py`).
With `cuda_graphs` (auto: on for CUDA) decode-only steps run over static buffers, as CUDA graphs on CUDA (`graph_step.py`).
With `kv_dtype` int8 / fp8 the pool holds quantized entries (sparserl/kv/kv_dtype.py); those steps then run eagerly.
`with engine.dense():` generates without KV compression in an engine built with a policy (the trainer's
rescue of rejected samples, `algo.correction.rescue=dense`): reservations are then the dense worst case.

Multi-turn sessions (`supports_sessions`): a request with `keep_session=True` leaves each sample's KV in the
pool under `Generation.session_id`; the next turn sends that key as its `session_id` with the whole history
as its prompt, and only the tokens after the held ones are prefilled (compressed caches carry over). The
held slots count against the pool and are dropped under pressure (policy in `sessions.py`). A caller's loop:

    gens = engine.generate([GenerationRequest(prompt, params, i, session_id=i, keep_session=True) ...])
    ...  # per live trajectory: history = prompt + response (+ observation), next turn:
    gens = engine.generate([GenerationRequest(history, params.replace(n=1), i, session_id=gen.session_id,
                                              keep_session=not last_turn) ...])
    engine.end_sessions()  # after the rollout (trajectories that ended early, errors): frees every held slot
"""
from __future__ import annotations

import time
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator

import torch

from sparserl.kv import KVPolicyConfig
from sparserl.kv.kv_dtype import resolve_kv_dtype
from sparserl.engines.protocol import EngineStats
from sparserl.engines.native import rescore
from sparserl.engines.native.compressor import Compressor
from sparserl.engines.native.decode_cache import resolve_decode_cache
from sparserl.engines.native.graph_step import resolve_cuda_graphs
from sparserl.engines.native.prepack import resolve_prepack
from sparserl.engines.native.options import NativeOptions
from sparserl.engines.native.partial import CutoffWatch, check_resume, resume_plan, resume_sequence
from sparserl.engines.native.runner import ModelRunner
from sparserl.engines.native.sampler import Sampler
from sparserl.engines.native.scheduler import ScheduledBatch, Scheduler
from sparserl.engines.native.sequence import Sequence, Status
from sparserl.engines.native.sessions import SessionTable, check_extends, choose_victims, session_keys
from sparserl.engines.native.slot_pool import SlotPool
from sparserl.engines.native.outputs import default_eos, finish_reason, to_generation
from sparserl.engines.types import Cutoff, Generation, GenerationRequest
from sparserl.utils.logging import log0


@dataclass
class StepTrace:
    """What one engine step did (recorded only when `engine.trace` is a list)."""

    step: int
    admitted: list[tuple[int, int]]  # (request index, sample index) prefilled or forked in this step
    decoding: list[tuple[int, int]]
    finished: list[tuple[int, int]]
    slots_used: int
    pool_high_water: int
    retracted: list[tuple[int, int]] = field(default_factory=list)  # gave their slots back at this step's start


class NativeEngine:
    supports_sessions = True
    supports_partial = True  # generate(..., cutoff=) and GenerationRequest.resume (partial.py)
    receives_weights = True  # the engine lives in this process (engines/weight_sync.py)

    def __init__(self, model: torch.nn.Module, tokenizer=None, options: NativeOptions | None = None, seed: int = 0,
                 eos_token_ids: Iterable[int] | None = None, **option_fields) -> None:
        """`options`, or its fields as keywords (`NativeEngine(model, num_slots=512, kv=...)`); keywords given
        with `options` replace its fields."""
        o = self.options = dataclasses.replace(options or NativeOptions(), **option_fields)
        self.tokenizer = tokenizer
        # True: sleep() also drops the weights (the actor pushes fresh ones after every update anyway).
        self.release_weights = o.release_weights
        param = next(model.parameters())
        graphs = resolve_cuda_graphs(o.cuda_graphs, param.device, model)  # the static decode step keeps no decode cache
        kv_format = resolve_kv_dtype(o.kv_dtype, param.dtype)
        if graphs and not kv_format.plain:
            # The static step's attention (and the Triton kernel under it) reads a pool in the compute dtype only.
            log0(f"rollout.kv_dtype={o.kv_dtype}: decode steps run eagerly (rollout.cuda_graphs={o.cuda_graphs} is not "
                 f"used): the captured decode step and its Triton kernel do not read a {kv_format.name} pool yet")
            graphs = False
        if graphs and o.decode_cache == "on":  # cuda_graphs=auto on CUDA (both on is a config error)
            log0("rollout.decode_cache=on is not used: the captured decode step (rollout.cuda_graphs=auto on CUDA) keeps "
                 "its own static buffers; rollout.cuda_graphs=off for the decode cache")
        self.runner = ModelRunner(model, o.num_slots, o.quantization, o.quant_kernel, o.quantize_lm_head,
                                  resolve_decode_cache(o.decode_cache, param.device) and not graphs,
                                  resolve_prepack(o.prepack, param.device, param.dtype, o.quantization),
                                  graphs, o.max_num_seqs, o.kv_dtype)
        self.quantization = o.quantization
        # Measure-only: sequences per generate() re-scored with a dense cache (rollout/kv_mismatch_kl).
        self.rescore_seqs = o.rescore_seqs
        self.num_slots, self.max_num_seqs, self.max_batch_tokens = o.num_slots, o.max_num_seqs, o.max_batch_tokens
        self.seed = seed
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else default_eos(model, tokenizer))
        self.kv = o.kv or KVPolicyConfig()
        # None keeps a dense cache; otherwise sequences are compressed while they decode.
        self.compression = None if self.kv.algorithm == "none" else Compressor(self.kv, self.runner, o.max_num_seqs, tokenizer)
        self._set_aside: Compressor | None = None  # the compressor, while `dense()` runs without it
        self._stats = self._fresh_stats()
        self._awake = False
        self._next_seq_id = 0
        # Slot bookkeeping lives as long as the engine: held sessions keep slots between generate() calls.
        self.pool = SlotPool(o.num_slots)
        self.sessions = SessionTable()
        self.trace: list[StepTrace] | None = None  # set to [] to record every step of the next generate()
        self.wake()

    # ----------------------------------------------------------------- lifecycle
    def wake(self) -> None:
        if self.runner.weights_released:
            raise RuntimeError("the rollout engine's weights were released by sleep(); push weights (update_weights) before wake()")
        self.runner.allocate()
        self._awake = True

    def sleep(self) -> None:
        self.end_sessions()  # the pool tensors go away; nothing may still point into them
        self.runner.release()
        compressor = self.compression or self._set_aside  # a sleep inside dense() frees the query ring too
        if compressor is not None:
            compressor.release()
        if self.release_weights:
            self.runner.release_weights()
        self._awake = False

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def set_kv_budget(self, budget: int) -> None:
        """The compression budget of sequences that start from now on (`rollout.kv.budget=auto` moves it between
        steps); sequences already running or held in a session keep theirs."""
        if self.compression is None:
            raise ValueError("set_kv_budget needs a compressing engine (rollout.kv.algorithm other than none)")
        self.kv = self.kv.with_budget(budget)
        self.options = dataclasses.replace(self.options, kv=self.kv)
        self.compression.cfg = self.kv

    @contextmanager
    def dense(self) -> Iterator[None]:
        """Inside the block every generate() keeps a dense (uncompressed) KV cache, as an engine built with
        `rollout.kv.algorithm=none` would: same seeds, same sampler, same tokens. Held sessions are ended on
        entry and on exit: a compressed session's state cannot continue densely, nor a dense one compressed."""
        if self.compression is None:  # a dense engine, or already inside the block
            yield
            return
        self.end_sessions()
        self._set_aside, self.compression = self.compression, None
        try:
            yield
        finally:
            self.end_sessions()
            self.compression, self._set_aside = self._set_aside, None

    def close(self) -> None:
        """Drop the pool, the held sessions and the weight copy (the engine cannot generate again)."""
        self.sleep()
        self.runner.release_weights()

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype update_weights casts every tensor to, so sync_weights gathers in it. None (as the actor holds
        them) with quantization, whose layers are quantized from the tensor as it arrives, or when the model's
        floating tensors do not share one dtype."""
        if self.quantization != "none":
            return None
        dtypes = {t.dtype for t in self.runner.model.state_dict().values() if t.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else None

    def update_weights(self, named_tensors) -> None:
        self.end_sessions()  # held KV was computed with the old weights
        self.runner.load_weights(named_tensors)

    def end_sessions(self, session_ids: Iterable[Hashable] | None = None) -> int:
        """Release the KV held for these session keys (None: every session); unknown keys (never kept, already
        ended, or dropped under pool pressure) are ignored. Returns how many sessions were released."""
        ended = self.sessions.pop(session_ids)
        for session in ended:
            self.pool.free(session.slots)
        self._check_pool()
        return len(ended)

    def _check_pool(self) -> None:
        assert self.pool.num_used == self.sessions.held_slots, (
            f"slots leaked: {self.pool.num_used} in use, {self.sessions.held_slots} held by sessions")

    def stats(self) -> EngineStats:
        if self.runner.graphs is not None:  # CUDA graphs captured since the last reset, and the seconds they took
            self._stats.extra["rollout/graph_captures"] = float(self.runner.graphs.captures - self._captures_at_reset)
            self._stats.extra["rollout/graph_capture_s"] = self.runner.graphs.capture_s - self._capture_s_at_reset
        return self._stats

    def reset_stats(self) -> None:
        self._stats = self._fresh_stats()

    def _fresh_stats(self) -> EngineStats:
        r = self.runner
        self._kv_sums = [0.0, 0]  # re-scored (sum of logp_sparse - logp_engine_dense, tokens) since the reset
        self._captures_at_reset = r.graphs.captures if r.graphs is not None else 0
        self._capture_s_at_reset = r.graphs.capture_s if r.graphs is not None else 0.0
        extra = {"rollout/weight_bytes": float(r.weight_bytes), "rollout/weight_bytes_saved": float(r.float_weight_bytes - r.weight_bytes)}
        return EngineStats(pool_slots=self.num_slots, kv_bytes_per_slot=r.bytes_per_slot, extra=extra)

    # ----------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None,
                 cutoff: Cutoff | None = None) -> list[Generation]:
        if not self._awake:
            raise RuntimeError("the native engine is asleep; call wake() before generate()")
        seqs = self._make_sequences(requests)
        pool = self.pool
        pool.reset_high_water()
        held = self.sessions.held_slots + sum(len(s.slots) for s in seqs)
        o = self.options
        scheduler = Scheduler(pool, self.max_num_seqs, self.max_batch_tokens, held, self._make_room, o.admission,
                              o.admission_watermark, self._retracted)
        sampler = Sampler(self.seed)
        for seq in seqs:
            scheduler.add(seq)
        watch = CutoffWatch(cutoff, seqs) if cutoff is not None else None  # partial rollouts (partial.py)
        t0 = time.perf_counter()
        try:
            while scheduler.has_work():
                batch = scheduler.schedule()
                if not len(batch):  # reservations are checked up front; only held sessions can block the pool
                    raise RuntimeError(
                        f"the KV pool ({self.num_slots} slots) cannot admit the next sequence next to the "
                        f"{scheduler.held} slots held by sessions that cannot be re-prefilled in it; raise "
                        "rollout.kv_memory (or rollout.kv_pool_tokens) or end sessions earlier")
                self._step(batch, scheduler, sampler, progress)
                if watch is not None:  # the sequences it stops go back to the caller as drawn so far
                    watch.stop_due(scheduler, lambda seq: self._retire(seq, "abort", scheduler, sampler))
        except BaseException:
            self._abandon(seqs)
            raise
        self._account(seqs, scheduler, pool, time.perf_counter() - t0)
        if self.rescore_seqs > 0:
            self._rescore(seqs)
        return [to_generation(s, requests[s.request_index], self.tokenizer) for s in seqs]

    def _make_sequences(self, requests: list[GenerationRequest]) -> list[Sequence]:
        # Every request is checked before any session is taken, so a bad request leaves the engine as it was.
        plans = []
        keys_seen: set = set()
        for i, req in enumerate(requests):
            params = req.params
            params.validate()
            prompt = list(req.prompt_token_ids)
            if not prompt:
                raise ValueError(f"request {req.request_id!r}: empty prompt; give at least one token")
            if params.stop_strings and self.tokenizer is None:
                raise ValueError(f"request {req.request_id!r}: stop_strings need an engine built with a tokenizer")
            if req.resume is not None:
                check_resume(req)
            keys = session_keys(req.session_id, params.n)
            for key in keys:
                if key in keys_seen:
                    raise ValueError(f"request {req.request_id!r}: session {key!r} appears twice in one generate() call")
                keys_seen.add(key)
            if params.n > 1 and keys:
                taken = [k for k in [req.session_id, *keys] if k in self.sessions]
                if taken:
                    raise ValueError(f"request {req.request_id!r}: session {taken[0]!r} is held, and a continued turn has "
                                     f"n=1 (got n={params.n}); n>1 opens new sessions (id, sample index): end it first")
            held = self.sessions.get(keys[0]) if keys and params.n == 1 else None
            kv = self.compression.cfg if self.compression is not None else None  # what the sequence compresses under
            if held is not None:
                check_extends(held.tokens, prompt, keys[0], req.request_id)
                reserve = self._reserve(len(prompt), params.max_new_tokens, len(held.slots), len(held.tokens))
            elif req.resume is not None:  # keeps the budget it was drawn under (partial.py)
                kv, reserve = resume_plan(self.compression, req.resume, len(prompt), params.max_new_tokens)
            else:
                reserve = self._reserve(len(prompt), params.max_new_tokens)
            if reserve > self.num_slots:
                raise ValueError(
                    f"request {req.request_id!r}: a prompt of {len(prompt)} tokens with max_new_tokens="
                    f"{params.max_new_tokens} needs up to {reserve} KV slots, but the pool has {self.num_slots}; "
                    "raise rollout.kv_memory (or rollout.kv_pool_tokens), shorten the prompt or lower "
                    "rollout.max_new_tokens"
                    + (" (this is a dense generation, engine.dense(): its worst case is uncompressed)"
                       if self._set_aside is not None else "")
                )
            plans.append((req, prompt, keys, held is not None, reserve, kv))
        seqs = []
        for i, (req, prompt, keys, continues, reserve, kv) in enumerate(plans):
            for j in range(req.params.n):
                seq = Sequence(self._next_seq_id, i, j, prompt, req.params, reserve, seed_index=req.seed_index, kv=kv)
                self._next_seq_id += 1
                if keys:
                    seq.session, seq.keep = keys[j], req.keep_session
                if continues:
                    session = self.sessions.take(keys[0])
                    seq.slots, seq.carry = session.slots, session.carry
                    seq.num_cached = seq.reused = len(session.tokens)
                    # A re-prefill would compress the earlier turns afresh, not as the held cache was compressed.
                    seq.retractable = self.compression is None
                if req.resume is not None:
                    resume_sequence(seq, req.resume, kv is not None)
                seqs.append(seq)
        return seqs

    def _reserve(self, prompt_len: int, max_new_tokens: int, held_slots: int = 0, reused: int = 0) -> int:
        """Worst-case slots of a sequence; a continued session starts with `held_slots` entries for the first
        `reused` prompt tokens and prefills the rest."""
        cached = held_slots + prompt_len - reused  # entries after prefill
        # The last sampled token is never fed back, so a sequence holds at most cached + max_new - 1 entries.
        dense = cached + max_new_tokens - 1
        if self.compression is None:
            return dense
        return min(dense, self.compression.max_slots(cached, max_new_tokens, floor_len=prompt_len - reused))

    def _make_room(self, head: Sequence, shortfall: int, waiting) -> int:
        """The scheduler's eviction hook: drop held sessions (`sessions.choose_victims`) so that `shortfall`
        slots come free for `head` (None: for the running sequences' next tokens); returns the slots freed (0:
        nothing dropped)."""
        fits = lambda seq: self._reserve(len(seq.prompt), seq.params.max_new_tokens) <= self.num_slots  # noqa: E731
        freed = 0
        for victim in choose_victims(self.sessions.least_recently_used(), waiting, head, shortfall, fits):
            if isinstance(victim, Sequence):
                freed += len(victim.slots)
                self._restart(victim)
            else:
                session = self.sessions.take(victim.key)
                freed += len(session.slots)
                self.pool.free(session.slots)
            self._stats.sessions_dropped += 1
        return freed

    def _restart(self, seq: Sequence) -> None:
        """A waiting sequence gives up the session it continues and will prefill its whole prompt."""
        assert seq.status is Status.WAITING and not seq.output
        self.pool.free(seq.slots)
        seq.slots, seq.num_cached, seq.reused, seq.carry = [], 0, 0, None
        seq.reserve = self._reserve(len(seq.prompt), seq.params.max_new_tokens)

    def _retracted(self, seq: Sequence) -> None:
        """The scheduler's retraction hook (its slots are back in the pool): forget the sequence's rows and
        compression state. It prefills prompt + output again, a compressed one in stretches that stop where it was
        compacted (`Compressor.replay_due`); a dense session continuation prefills its whole history."""
        self.runner.forget(seq)
        if seq.reused:
            seq.reused, seq.carry = 0, None
            seq.reserve = self._reserve(len(seq.prompt), seq.params.max_new_tokens)
        if self.compression is not None:
            self.compression.forget(seq)
            seq.replay_ends = [len(seq.prompt) + c - 1 for c in seq.compressed_at]

    def _abandon(self, seqs: list[Sequence]) -> None:
        """After an exception inside generate(): free every slot of this call and drop the sessions it continued
        or created (their caller never saw the turn); sessions it did not touch stay held."""
        for seq in seqs:
            for session in self.sessions.pop([seq.session] if seq.session is not None else []):
                self.pool.free(session.slots)
            if seq.slots:
                self.pool.free(seq.slots)
                seq.slots = []
            self.runner.forget(seq)
            if self.compression is not None:
                self.compression.forget(seq)
        self._check_pool()

    def _step(self, batch: ScheduledBatch, scheduler: Scheduler, sampler: Sampler, progress) -> None:
        if self.runner.graphs is not None and not batch.prefill and not batch.forks:  # decode only: static buffers
            sampled = batch.decode
            tokens, logps = self.runner.graphs.step(sampled, sampler, self.compression)
        else:
            on_queries = self.compression.on_queries(batch) if self.compression is not None else None
            self._stats.prefill_tokens += sum(s.num_pending for s in batch.prefill)
            logits = self.runner.forward(batch, on_queries)  # (decode + prefill rows, V)
            if self.compression is not None:
                self.compression.after_forward(batch)
            sampled, tokens, logps = sampler.sample_batch(logits, batch)
            if self.compression is not None:
                self.compression.replay_due(batch.prefill, scheduler)
        self._stats.forward_steps += 1
        finished = 0
        for seq, tok, lp in zip(sampled, tokens, logps):
            seq.output.append(tok)
            seq.logps.append(lp)
            reason = finish_reason(seq, tok, self.eos_token_ids, self.tokenizer)
            if reason is not None:
                self._retire(seq, reason, scheduler, sampler)
                finished += 1
        if self.compression is not None:
            self.compression.after_step([s for s in sampled if s.finish_reason is None], scheduler)
        self._stats.peak_running = max(self._stats.peak_running, len(scheduler.running) + finished)
        self._stats.running_sum += len(scheduler.running) + finished
        if progress is not None and finished:
            progress(finished)
        if self.trace is not None:
            key = lambda s: (s.request_index, s.sample_index)  # noqa: E731
            self.trace.append(StepTrace(
                step=scheduler.step_index - 1,
                admitted=[key(s) for s in batch.prefill + batch.forks],
                decoding=[key(s) for s in batch.decode],
                finished=[key(s) for s in sampled if s.finish_reason is not None],
                slots_used=scheduler.pool.num_used,
                pool_high_water=scheduler.pool.high_water,
                retracted=[key(s) for s in batch.retracted],
            ))

    def _retire(self, seq: Sequence, reason: str, scheduler: Scheduler, sampler: Sampler) -> None:
        """Finish a sequence; with `keep_session` its slots (and compression state) become a held session."""
        keep = seq.keep and seq.session is not None
        scheduler.finish(seq, reason, keep)
        sampler.forget(seq)
        self.runner.forget(seq)
        carry = None
        if self.compression is not None and keep:
            carry = self.compression.detach(seq)
        elif self.compression is not None:
            self.compression.forget(seq)
        if keep:
            # The last sampled token was never fed back: the held slots cover tokens[:num_cached].
            self.sessions.put(seq.session, seq.tokens[: seq.num_cached], seq.slots, carry)
            seq.slots = []

    def _account(self, seqs: list[Sequence], scheduler: Scheduler, pool: SlotPool, elapsed: float) -> None:
        self._check_pool()
        assert scheduler.held == self.sessions.held_slots and scheduler.reserved == 0, "slot accounting drifted"
        st = self._stats
        st.generate_s += elapsed
        st.new_tokens += sum(len(s.output) - s.resumed for s in seqs)
        st.prompt_tokens += sum(len(s.prompt) for s in seqs)
        st.sessions_continued += sum(s.reused > 0 for s in seqs)
        st.session_reused_tokens += sum(s.reused for s in seqs)
        st.peak_slots = max(st.peak_slots, pool.high_water)
        st.peak_running = max(st.peak_running, scheduler.peak_running)
        st.compressions += sum(s.compressions for s in seqs)
        st.compress_s += sum(s.compress_s for s in seqs)
        st.retractions += sum(s.retractions for s in seqs)
        st.recomputed_tokens += sum(s.recomputed for s in seqs)

    def _rescore(self, seqs: list[Sequence]) -> None:
        """Accumulate the KV-compression share of the mismatch over this step's re-scored tokens."""
        diff, tokens = rescore.kv_share(self.runner.model, rescore.pick(seqs, self.rescore_seqs))
        self._kv_sums[0] += diff
        self._kv_sums[1] += tokens
        self._stats.extra["rollout/rescored_tokens"] = float(self._kv_sums[1])
        self._stats.extra["rollout/kv_mismatch_kl"] = self._kv_sums[0] / max(self._kv_sums[1], 1)

def build_native_engine(**kwargs) -> NativeEngine:
    return NativeEngine(**kwargs)
