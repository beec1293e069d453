"""The native rollout engine: continuous batching over a KV slot pool, on the Hugging Face model's modules.

`generate` admits requests while their worst-case KV need fits the pool, runs one packed forward per step
(prefill of new sequences and one decode token of every running one), samples with per-sequence
generators, and retires sequences on a stop token, a stop string or `max_new_tokens`, freeing their slots
for the next waiting ones. Left out on purpose: an async/streaming API (the trainer wants whole batches),
prefix caching across prompts (the `n` samples of one prompt do share its prefill), speculative decoding.
With `quantization` the linear layers hold int8 / fp8 weights, re-quantized at every weight update
(`quantize.py`); `rescore_seqs` re-scores a few sequences densely to split the mismatch (`rescore.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from sparserl.kv import KVPolicyConfig
from sparserl.rollout.engine import EngineStats, register_engine
from sparserl.rollout.native import rescore
from sparserl.rollout.native.compressor import Compressor
from sparserl.rollout.native.runner import ModelRunner
from sparserl.rollout.native.sampler import Sampler
from sparserl.rollout.native.scheduler import ScheduledBatch, Scheduler
from sparserl.rollout.native.sequence import Sequence
from sparserl.rollout.native.slot_pool import SlotPool
from sparserl.rollout.types import Generation, GenerationRequest, KVStats


@dataclass
class StepTrace:
    """What one engine step did (recorded only when `engine.trace` is a list)."""

    step: int
    admitted: list[tuple[int, int]]  # (request index, sample index) prefilled or forked in this step
    decoding: list[tuple[int, int]]
    finished: list[tuple[int, int]]
    slots_used: int
    pool_high_water: int


class NativeEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        num_slots: int = 65536,
        max_num_seqs: int = 256,
        max_batch_tokens: int = 8192,
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        kv: KVPolicyConfig | None = None,
        release_weights: bool = False,
        quantization: str = "none",
        quant_kernel: str = "auto",
        quantize_lm_head: bool = False,
        rescore_seqs: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # True: sleep() also drops the weights (the actor pushes fresh ones after every update anyway).
        self.release_weights = release_weights
        self.runner = ModelRunner(model, num_slots, quantization, quant_kernel, quantize_lm_head)
        self.quantization = quantization
        # Measure-only: sequences per generate() re-scored with a dense cache (rollout/kv_mismatch_kl).
        self.rescore_seqs = rescore_seqs
        self.num_slots = num_slots
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.seed = seed
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else _default_eos(model, tokenizer))
        self.kv = kv or KVPolicyConfig()
        # None keeps a dense cache; otherwise sequences are compressed while they decode.
        self.compression = None if self.kv.algorithm == "none" else Compressor(self.kv, self.runner, max_num_seqs, tokenizer)
        self._stats = self._fresh_stats()
        self._awake = False
        self._next_seq_id = 0
        self.trace: list[StepTrace] | None = None  # set to [] to record every step of the next generate()
        self.wake()

    # ----------------------------------------------------------------- lifecycle
    def wake(self) -> None:
        if self.runner.weights_released:
            raise RuntimeError("the rollout engine's weights were released by sleep(); push weights (update_weights) before wake()")
        self.runner.allocate()
        self._awake = True

    def sleep(self) -> None:
        self.runner.release()
        if self.compression is not None:
            self.compression.release()
        if self.release_weights:
            self.runner.release_weights()
        self._awake = False

    def update_weights(self, named_tensors) -> None:
        self.runner.load_weights(named_tensors)

    def stats(self) -> EngineStats:
        return self._stats

    def reset_stats(self) -> None:
        self._stats = self._fresh_stats()

    def _fresh_stats(self) -> EngineStats:
        r = self.runner
        self._kv_sums = [0.0, 0]  # re-scored (sum of logp_sparse - logp_engine_dense, tokens) since the reset
        extra = {"rollout/weight_bytes": float(r.weight_bytes), "rollout/weight_bytes_saved": float(r.float_weight_bytes - r.weight_bytes)}
        return EngineStats(pool_slots=self.num_slots, kv_bytes_per_slot=r.bytes_per_slot, extra=extra)

    # ----------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None) -> list[Generation]:
        if not self._awake:
            raise RuntimeError("the native engine is asleep; call wake() before generate()")
        seqs = self._make_sequences(requests)
        pool = SlotPool(self.num_slots)
        scheduler = Scheduler(pool, self.max_num_seqs, self.max_batch_tokens)
        sampler = Sampler(self.seed)
        for seq in seqs:
            scheduler.add(seq)
        t0 = time.perf_counter()
        while scheduler.has_work():
            batch = scheduler.schedule()
            assert len(batch), "scheduler made no progress"  # reservations are checked up front
            self._step(batch, scheduler, sampler, progress)
        self._account(seqs, scheduler, pool, time.perf_counter() - t0)
        if self.rescore_seqs > 0:
            self._rescore(seqs)
        return [self._to_generation(s, requests[s.request_index]) for s in seqs]

    def _make_sequences(self, requests: list[GenerationRequest]) -> list[Sequence]:
        seqs = []
        for i, req in enumerate(requests):
            params = req.params
            params.validate()
            prompt = list(req.prompt_token_ids)
            if not prompt:
                raise ValueError(f"request {req.request_id!r}: empty prompt; give at least one token")
            if params.stop_strings and self.tokenizer is None:
                raise ValueError(f"request {req.request_id!r}: stop_strings need an engine built with a tokenizer")
            reserve = self._reserve(len(prompt), params.max_new_tokens)
            if reserve > self.num_slots:
                raise ValueError(
                    f"request {req.request_id!r}: a prompt of {len(prompt)} tokens with max_new_tokens="
                    f"{params.max_new_tokens} needs up to {reserve} KV slots, but the pool has {self.num_slots}; "
                    "raise rollout.kv_pool_tokens, shorten the prompt or lower rollout.max_new_tokens"
                )
            for j in range(params.n):
                seqs.append(Sequence(self._next_seq_id, i, j, prompt, params, reserve, seed_index=req.seed_index))
                self._next_seq_id += 1
        return seqs

    def _reserve(self, prompt_len: int, max_new_tokens: int) -> int:
        # The last sampled token is never fed back, so a sequence holds at most prompt + max_new - 1 entries.
        dense = prompt_len + max_new_tokens - 1
        if self.compression is None:
            return dense
        return min(dense, self.compression.max_slots(prompt_len, max_new_tokens))

    def _step(self, batch: ScheduledBatch, scheduler: Scheduler, sampler: Sampler, progress) -> None:
        on_queries = self.compression.on_queries(batch) if self.compression is not None else None
        logits = self.runner.forward(batch, on_queries)  # (decode + prefill rows, V)
        computed = batch.decode + batch.prefill
        for seq in computed:
            seq.num_cached += seq.num_pending
        row_of = {id(s): i for i, s in enumerate(computed)}
        for seq in batch.forks:
            seq.num_cached = len(seq.prompt)
            row_of[id(seq)] = row_of[id(seq.fork_of)]
        sampled = computed + batch.forks
        rows = logits[torch.tensor([row_of[id(s)] for s in sampled], device=logits.device)]
        tokens, logps = sampler.sample(rows, sampled)
        self._stats.forward_steps += 1
        finished = 0
        for seq, tok, lp in zip(sampled, tokens, logps):
            seq.output.append(tok)
            seq.logps.append(lp)
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                scheduler.finish(seq, reason)
                sampler.forget(seq)
                self.runner.table.forget(seq)
                if self.compression is not None:
                    self.compression.forget(seq)
                finished += 1
        if self.compression is not None:
            self.compression.after_step(batch, [s for s in sampled if s.finish_reason is None], scheduler)
        self._stats.peak_running = max(self._stats.peak_running, len(scheduler.running) + finished)
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
            ))

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if (tok in p.stop_token_ids) or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if p.stop_strings and self._hits_stop_string(seq):
            return "stop"
        if len(seq.output) >= p.max_new_tokens:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop_strings)
        # A token decodes to at least one character, so the last `longest` tokens cover any match that
        # the newest token could have completed.
        tail = self.tokenizer.decode(seq.output[-(longest + 1) :], skip_special_tokens=False)
        return any(s in tail for s in seq.params.stop_strings)

    def _account(self, seqs: list[Sequence], scheduler: Scheduler, pool: SlotPool, elapsed: float) -> None:
        assert pool.num_free == pool.num_slots, "slots leaked"
        st = self._stats
        st.generate_s += elapsed
        st.new_tokens += sum(len(s.output) for s in seqs)
        st.prompt_tokens += sum(len(s.prompt) for s in seqs)
        st.peak_slots = max(st.peak_slots, pool.high_water)
        st.peak_running = max(st.peak_running, scheduler.peak_running)
        st.compressions += sum(s.compressions for s in seqs)
        st.compress_s += sum(s.compress_s for s in seqs)

    def _rescore(self, seqs: list[Sequence]) -> None:
        """Accumulate the KV-compression share of the mismatch over this step's re-scored tokens."""
        diff, tokens = rescore.kv_share(self.runner.model, rescore.pick(seqs, self.rescore_seqs))
        self._kv_sums[0] += diff
        self._kv_sums[1] += tokens
        self._stats.extra["rollout/rescored_tokens"] = float(self._kv_sums[1])
        self._stats.extra["rollout/kv_mismatch_kl"] = self._kv_sums[0] / max(self._kv_sums[1], 1)

    def _to_generation(self, seq: Sequence, req: GenerationRequest) -> Generation:
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True) if self.tokenizer is not None else None
        kv = KVStats(
            peak_slots=seq.peak_slots,
            retained_tokens=seq.retained_at_finish,
            total_tokens=seq.num_tokens - 1,
            compressions=seq.compressions,
            compress_s=seq.compress_s,
            compressed_at=list(seq.compressed_at),
        )
        return Generation(req.request_id, seq.sample_index, seq.prompt, list(seq.output), list(seq.logps), seq.finish_reason, text, kv)


def _default_eos(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return ids


@register_engine("native")
def build_native_engine(**kwargs) -> NativeEngine:
    return NativeEngine(**kwargs)
