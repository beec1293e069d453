"""The SGLang rollout engine: an in-process `sglang.Engine` behind the contract of `engines/protocol.py`.

One `sglang.Engine` per tensor-parallel group, started by the group's first rank with `tp_size=parallel.tp`;
the group's other ranks take part in weight sync (they gather like everyone, then drop the tensors) and do not
generate: the trainer hands them the owner's finished samples over a gloo side group (parallel.ReplicaGroup).
Data-parallel groups each own an engine.

- `generate` expands each request into its `n` samples, each with its own seed (engine seed, request index,
  sample index, as the native engine), and sends them as separate SGLang requests: SGLang's radix cache
  shares the prompt's prefill among them. The draws and `logp_sparse` come from sparserl's sampler inside
  SGLang (`sampler_plugin.py`), so the log-probs are the processed distribution's (temperature, top-k, top-p);
  each sample's seed and settings travel in its `custom_params`.
- `update_weights` opens a weight-update session (`begin_weight_update`, required by SGLang 0.5.23) and
  loads the tensors in buckets of `rollout.sglang.weight_bucket_mb` under their Hugging Face names; SGLang's
  loaders fuse q/k/v and gate/up. The session is closed, and the prefix cache flushed, before the engine is
  next used: the weight-sync protocol has no "last bucket" call.
- `sleep` / `wake` are `release_memory_occupation` / `resume_memory_occupation` (KV cache, CUDA graphs and,
  with `release_weights`, the weights). Weights released by `sleep` must be reloaded before `wake`.

- Partial rollouts (`supports_partial`, sparserl/rollout/partial.py): `generate(..., cutoff=)` sends each sample
  with its own SGLang request id and, once `cutoff.finish_frac` of the call's samples have ended (and no exempt one
  still runs), aborts the others through SGLang's `abort_request`; they come back with finish_reason "abort" and the
  tokens they drew. `cutoff.max_tokens` caps each non-exempt sample's new tokens in the call (a sample stopped there
  is "abort" too, unless it reached its own `max_new_tokens`). A `GenerationRequest.resume` is sent as prompt + the
  drawn tokens with the remaining budget, under the sample's own seed: the draws are keyed by logical position
  (sampler_plugin.py), so it draws on from the same stream. Dense, with the weights unchanged, a carried sample is
  an uninterrupted one; with KV compression the drawn tokens are re-prefilled as prompt tokens and compressed by
  the backend's prompt rule (`rollout.kv.compress_prompt`), not compacted again where they were (the native
  engine replays its compaction points), so its cache after a resume differs from the uninterrupted one's.
- Sessions (`supports_sessions = False`): `session_id` / `keep_session` are ignored; every turn's request
  carries the whole history and is prefilled from it, with SGLang's radix cache reusing what it still holds
  of the earlier turns. `Generation.session_id` is None and `end_sessions` does nothing.

- KV compression (`options.kv`): SGLang runs sparserl's `sparserl_kv` attention backend (kv_backend.py) over
  its base backend, with the policy in `SPARSERL_SGLANG_KV`; each generation's `KVStats` come from the
  backend's per-token records and the engine's `peak_slots` / `peak_running` / `compressions` from the
  scheduler's pool counters, read after every `generate`, which also checks that every slot came back.

SGLang's own `asyncio` loop runs on one helper thread: the env loop calls `generate` from inside its own
running event loop, where SGLang's `run_until_complete` would refuse to run.
Left out on purpose: streaming, multi-node engines, and peak KV-slot accounting of dense engines (SGLang does
not report it per call; there `kv/peak_slots` is 0).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

import torch

from sparserl.engines.protocol import EngineStats
from sparserl.engines.sglang import KV_ENV, SAMPLER_ENV_FLAG
from sparserl.engines.sglang.kv_records import RECORD_KEY, PoolCounters, drawn_positions, kv_stats, pool_counters
from sparserl.engines.sglang.options import SGLangOptions
from sparserl.engines.types import Cutoff, Generation, GenerationRequest, KVStats, SamplingParams, eos_ids
from sparserl.utils.seed import sample_seed
from sparserl.engines.weight_sync import buckets

MEMORY_TAGS = ("kv_cache", "cuda_graph", "weights")  # sglang.srt.constants.GPU_MEMORY_ALL_TYPES
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group: the owner (first rank) runs the engine."""

    rank: int
    owner: int
    peers: tuple[int, ...]  # the group's other ranks

    @classmethod
    def of_rank(cls, rank: int, tp: int) -> "TPGroup":
        # ParallelDims lays the mesh out as (dp, tp), row-major: a TP group is `tp` consecutive ranks.
        owner = rank - rank % tp
        return cls(rank, owner, tuple(range(owner + 1, owner + tp)))

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner


@dataclass
class _Sample:
    """One SGLang request: sample `index` of request `request`."""

    request: int
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    rid: str = ""  # its SGLang request id (aborted by id under a cutoff; SGLang aborts every id it prefixes, so each
    # ends with "." and none is another's prefix)
    drawn: tuple[list[int], list[float], list[int]] | None = None  # a resumed sample's tokens, log-probs, compactions
    cap: int = 0  # the cutoff's per-call token bound on it (0: none)

    @property
    def budget(self) -> int:
        """New tokens SGLang may draw for it in this call."""
        left = self.params.max_new_tokens - (len(self.drawn[0]) if self.drawn else 0)
        return min(left, self.cap) if self.cap else left


class SGLangEngine:
    supports_sessions = False  # multi-turn requests re-prefill; the radix cache shares what it can
    supports_partial = True  # generate(..., cutoff=) and GenerationRequest.resume (module docstring)

    def __init__(self, model_path: str, options: SGLangOptions | None = None, tokenizer=None, seed: int = 0,
                 eos_token_ids: Iterable[int] | None = None, group: TPGroup | None = None) -> None:
        self.options = options or SGLangOptions()
        self.tokenizer = tokenizer
        self.seed = seed
        self.group = group or TPGroup(0, 0, ())
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else _default_eos(model_path, tokenizer)
        self._kv_bytes = _kv_bytes_per_token(model_path, self.options.dtype, self.options.kv_cache_dtype)
        self._pool_tokens = self.options.max_total_tokens
        self._stats = self._fresh_stats()
        self.kv_trace: dict = {}  # (request id, sample index) -> kept positions per compaction (options.kv_trace)
        self.draw_trace: dict = {}  # (request id, sample index) -> the position each token's noise was keyed by
        self._awake = True
        self._released: set[str] = set()
        self._updating = False
        self._engine = None
        self._thread = None
        self._calls = 0  # generate calls so far: part of every SGLang request id
        if self.group.is_owner:
            self._engine = _start_engine(model_path, self.options, seed)
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")
            # The pool SGLang actually allocated (it may size it from free memory, or cap a requested size).
            self._pool_tokens = int(self._call(self._engine.get_server_info).get("max_total_num_tokens") or self._pool_tokens)
            self._stats = self._fresh_stats()

    # ----------------------------------------------------------------- lifecycle
    def sleep(self) -> None:
        self._finish_weight_update()
        if self._engine is not None and self._awake:
            tags = [t for t in MEMORY_TAGS if t != "weights" or self.options.release_weights]
            self._call(self._engine.release_memory_occupation, tags)
            self._released.update(tags)
        self._awake = False

    def wake(self) -> None:
        self._finish_weight_update()
        if "weights" in self._released:
            raise RuntimeError("the SGLang engine's weights were released by sleep() and not reloaded; push the "
                               "weights (update_weights) before wake(), or set rollout.release_weights=false")
        if self._engine is not None and self._released:
            self._call(self._engine.resume_memory_occupation, sorted(self._released))
            self._released.clear()
        self._awake = True

    @property
    def receives_weights(self) -> bool:
        """False on a TP peer: sync_weights has it join the gathers but hand nothing over (the owner's engine loads)."""
        return self._engine is not None

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype update_weights casts to, so sync_weights gathers in it; None: as the actor holds them."""
        return _DTYPES.get(self.options.dtype)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._engine is None:  # a TP peer: the tensors were gathered for the owner's engine
            for _ in named_tensors:
                pass
            return
        if "weights" in self._released:
            self._call(self._engine.resume_memory_occupation, ["weights"])
            self._released.discard("weights")
        if not self._updating:
            self._check(self._call(self._engine.begin_weight_update), "begin_weight_update")
            self._updating = True
        dtype = _DTYPES.get(self.options.dtype)
        # Cast before handing over: SGLang would cast on load, and half-size tensors cross the process boundary.
        named = ((name, t.detach().to(dtype=dtype or t.dtype).contiguous()) for name, t in named_tensors)
        for bucket in buckets(named, self.options.weight_bucket_mb):
            self._check(self._call(self._engine.update_weights_from_tensor, bucket, None, False), "update_weights_from_tensor")

    def _finish_weight_update(self) -> None:
        if not self._updating:
            return
        self._check(self._call(self._engine.end_weight_update), "end_weight_update")
        self._call(self._engine.flush_cache)  # the prefix cache holds KV computed with the old weights
        self._updating = False

    def stats(self) -> EngineStats:
        return self._stats

    def reset_stats(self) -> None:
        self._stats = self._fresh_stats()

    def end_sessions(self, session_ids: Iterable[Hashable] | None = None) -> int:
        return 0  # nothing is held between turns (see `supports_sessions`)

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            self._thread.shutdown()

    # ----------------------------------------------------------------- generate
    def generate(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None,
                 cutoff: Cutoff | None = None) -> list[Generation]:
        if not self._awake:
            raise RuntimeError("the SGLang engine is asleep; call wake() before generate()")
        self._finish_weight_update()
        if self._engine is None:
            raise RuntimeError(f"rank {self.group.rank} is a tensor-parallel peer of rank {self.group.owner}, whose "
                               "SGLang engine serves the group: the owner runs the rollout and hands its samples to "
                               "the peers (sparserl.parallel.ReplicaGroup); a peer does not generate")
        samples = self._expand(requests, cutoff)
        t0 = time.perf_counter()
        outputs = self._thread.submit(self._engine.loop.run_until_complete,
                                      self._generate_all(samples, progress, cutoff)).result()
        self.kv_trace, self.draw_trace = {}, {}
        gens = [self._to_generation(s, requests[s.request], out) for s, out in zip(samples, outputs)]
        self._account(gens, time.perf_counter() - t0, len(samples))
        if self.options.kv is not None:
            self._account_pool(gens)
        return gens

    def _expand(self, requests: list[GenerationRequest], cutoff: Cutoff | None = None) -> list[_Sample]:
        from sparserl.engines.native.partial import check_resume

        out = []
        self._calls += 1
        for i, req in enumerate(requests):
            p = req.params
            p.validate()
            if not req.prompt_token_ids:
                raise ValueError(f"request {req.request_id!r}: empty prompt; give at least one token")
            base = self.seed if p.seed is None else p.seed
            index = i if req.seed_index is None else req.seed_index
            cap = cutoff.max_tokens if cutoff is not None and i not in cutoff.exempt else 0
            r = req.resume
            if r is not None:
                if p.n != 1:
                    raise ValueError(f"request {req.request_id!r}: a resumed request continues one sample (n=1), got n={p.n}")
                check_resume(req)
            for j in ([r.sample_index] if r is not None else range(p.n)):
                # The native engine's stream key: (seed, request seed index or position, sample index).
                seed = sample_seed(base, index, j)
                drawn = (list(r.token_ids), [float(x) for x in r.logp_sparse], list(r.compressed_at)) if r else None
                out.append(_Sample(i, j, list(req.prompt_token_ids), p, seed, f"sparserl-{id(self)}-{self._calls}-{len(out)}.",
                                   drawn, cap))
        return out

    async def _generate_all(self, samples: list[_Sample], progress, cutoff: Cutoff | None = None) -> list[dict]:
        """Every sample's SGLang output; under `cutoff`, the ones still running once enough have ended are aborted."""
        need = len(samples) if cutoff is None else math.ceil(cutoff.finish_frac * len(samples) - 1e-9)
        exempt = {k for k, s in enumerate(samples) if cutoff is not None and s.request in cutoff.exempt}
        running, ended = set(range(len(samples))), [0]

        async def one(k: int, s: _Sample) -> dict:
            prompt = s.prompt + (s.drawn[0] if s.drawn else [])
            out = await self._engine.async_generate(input_ids=prompt, sampling_params=self._sglang_params(s),
                                                    return_logprob=True, rid=s.rid)
            running.discard(k)
            capped = ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "length" and \
                s.budget < s.params.max_new_tokens - (len(s.drawn[0]) if s.drawn else 0)
            ended[0] += not capped  # a sample stopped by the per-call bound has not ended
            if progress is not None:
                progress(1)
            if cutoff is not None and ended[0] >= need and not exempt & running:
                for other in sorted(running):  # the cutoff: the rest stop here, with what they drew
                    self._engine.tokenizer_manager.abort_request(samples[other].rid)
            return out

        return await asyncio.gather(*(one(k, s) for k, s in enumerate(samples)))

    def _sglang_params(self, s: _Sample) -> dict[str, Any]:
        from sparserl.engines.sglang.sampler_plugin import PARAM_KEY

        p = s.params
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids  # the native engine's EOS set, whatever SGLang reads from the config
        return {
            "max_new_tokens": s.budget,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k or -1,
            "stop_token_ids": sorted(stop_ids) or None,
            "stop": list(p.stop_strings) or None,
            # SGLang ignores stop_token_ids too under ignore_eos; `_to_generation` cuts at them instead.
            "ignore_eos": p.ignore_eos,
            "no_stop_trim": True,  # text and token ids both keep the stop string, as in the native engine
            # Read by sparserl's sampler when SGLang builds the batch (sampler_plugin.BatchRows), not per step.
            "custom_params": {PARAM_KEY: [s.seed, p.temperature, p.top_p, p.top_k]},
        }

    def _to_generation(self, s: _Sample, req: GenerationRequest, out: dict) -> Generation:
        meta = out["meta_info"]
        ids = list(out.get("output_ids") or [])
        logps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        if len(logps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(logps)} log-probs for request {req.request_id!r}")
        reason = _FINISH.get((meta.get("finish_reason") or {}).get("type"), "abort")
        before, brought = (len(s.drawn[0]), s.drawn[2]) if s.drawn is not None else (0, [])
        if reason == "length" and s.budget < s.params.max_new_tokens - before:
            reason = "abort"  # stopped by the cutoff's per-call bound, not by its own max_new_tokens
        if s.drawn is not None:  # a resumed sample: its generation starts with what it brought
            ids, logps = s.drawn[0] + ids, s.drawn[1] + logps
        if s.params.ignore_eos and s.params.stop_token_ids:
            cut = next((k + 1 for k, t in enumerate(ids) if t in s.params.stop_token_ids), None)
            if cut is not None:
                ids, logps, reason = ids[:cut], logps[:cut], "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else out.get("text")
        total = len(s.prompt) + len(ids) - 1  # the last sampled token is never fed back
        if self.options.kv is not None:
            records = meta.get(RECORD_KEY) or []  # this call's tokens only: a resumed sample's came in its prompt
            kv, kept = kv_stats(records, len(s.prompt) + before, len(ids) - before)
            kv.compressed_at = list(brought) + [before + c for c in kv.compressed_at]
            if self.options.kv_trace:
                self.kv_trace[(req.request_id, s.index)] = kept
                self.draw_trace[(req.request_id, s.index)] = drawn_positions(records, len(ids) - before)
        else:
            kv = KVStats(peak_slots=total, retained_tokens=total, total_tokens=total)
        return Generation(req.request_id, s.index, s.prompt, ids, logps, reason, text, kv)

    # ----------------------------------------------------------------- helpers
    def _call(self, fn, *args):
        # Every call that runs SGLang's event loop goes through the one helper thread.
        return self._thread.submit(fn, *args).result()

    @staticmethod
    def _check(result, what: str) -> None:
        ok, message = (result[0], result[1]) if isinstance(result, tuple) else (getattr(result, "success", True), getattr(result, "message", ""))
        if not ok:
            raise RuntimeError(f"SGLang {what} failed: {message}")

    def _account(self, gens: list[Generation], elapsed: float, num_samples: int) -> None:
        st = self._stats
        st.generate_s += elapsed
        st.new_tokens += sum(len(g.token_ids) for g in gens)
        st.prompt_tokens += sum(len(g.prompt_token_ids) for g in gens)
        if self.options.kv is None:  # with compression the scheduler's own count comes in `_account_pool`
            st.peak_running = max(st.peak_running, min(num_samples, self.options.max_running_requests))

    def kv_counters(self) -> PoolCounters:
        """The `sparserl_kv` scheduler's counters since the last read (engines with KV compression, owner rank)."""
        return pool_counters(self._call(self._engine.get_server_info))

    def _account_pool(self, gens: list[Generation]) -> None:
        """The scheduler's pool counters since the last call; every slot must be free again (no radix cache)."""
        pool = self.kv_counters()
        if pool.pool_free != pool.pool_size:
            raise RuntimeError(f"sparserl_kv: {pool.pool_size - pool.pool_free} of {pool.pool_size} KV slots are still "
                               "allocated after every request finished (a leak), or were freed twice (negative)")
        st = self._stats
        st.peak_slots = max(st.peak_slots, pool.high_water)
        st.peak_running = max(st.peak_running, pool.peak_running)
        st.compressions += sum(g.kv.compressions for g in gens)
        st.compress_s += sum(g.kv.compress_s for g in gens)
        st.extra["kv/pool_free_after"] = float(pool.pool_free)
        st.extra["kv/pool_size"] = float(pool.pool_size)
        st.extra["kv/query_buffer_mb"] = pool.query_buffer_bytes / 2**20
        if pool.host_syncs >= 0:  # options.kv_count_syncs
            st.extra["kv/host_syncs"] = st.extra.get("kv/host_syncs", 0.0) + pool.host_syncs
            st.extra["kv/decode_forwards"] = st.extra.get("kv/decode_forwards", 0.0) + pool.decode_forwards

    def _fresh_stats(self) -> EngineStats:
        return EngineStats(pool_slots=self._pool_tokens, kv_bytes_per_slot=self._kv_bytes)


def _start_engine(model_path: str, options: SGLangOptions, seed: int):
    if options.device == "cpu":
        # SGLang's switch for its CPU code paths; read when sglang is first imported, here and in its subprocesses.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    # SGLang's processes (spawned, so they inherit the environment) load sparserl's sampler only under this flag.
    os.environ[SAMPLER_ENV_FLAG] = "1"
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "sparserl_sampler" not in {x.strip() for x in allowed.split(",")}:
        raise RuntimeError(f"SGLANG_PLUGINS={allowed} leaves out sparserl_sampler, without which logp_sparse would be "
                           "SGLang's unnormalized log-probs; add it or unset SGLANG_PLUGINS")
    if options.kv is not None:
        # SGLang's processes load the sparserl_kv backend and its scheduler hooks only under this variable.
        os.environ[KV_ENV] = json.dumps({"policy": options.kv, "base": options.base_attention_backend,
                                         "trace": options.kv_trace, "count_syncs": options.kv_count_syncs})
        if allowed and "sparserl_kv" not in {x.strip() for x in allowed.split(",")}:
            raise RuntimeError(f"SGLANG_PLUGINS={allowed} leaves out sparserl_kv, which KV compression needs; add it")
    else:
        os.environ.pop(KV_ENV, None)
    import sglang

    with _without_launcher_env():
        return sglang.Engine(**options.server_args(model_path, seed))


# Set by torchrun for the training processes. SGLang's spawned processes must not see them: with
# TORCHELASTIC_USE_AGENT_STORE=True, torch makes SGLang's own process group join torchrun's store, and every
# scheduler waits there forever.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def _without_launcher_env():
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k in _LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _default_eos(model_path: str, tokenizer) -> frozenset[int]:
    """The native engine's EOS set: generation config, model config, tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        gen_eos = None
    return eos_ids(gen_eos, AutoConfig.from_pretrained(model_path).eos_token_id, getattr(tokenizer, "eos_token_id", None))


def _kv_bytes_per_token(model_path: str, dtype: str, kv_cache_dtype: str | None = None) -> int:
    from transformers import AutoConfig

    from sparserl.utils.kv_memory import entry_bytes

    c = AutoConfig.from_pretrained(model_path)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    element = torch.tensor([], dtype=_DTYPES.get(dtype, torch.bfloat16)).element_size()
    if kv_cache_dtype is not None:  # its fp8 pool: one byte per element, one scale per layer (none per token)
        element = 1 if kv_cache_dtype.startswith("fp8") else 2
    return entry_bytes(c.num_hidden_layers, kv_heads, head_dim, element)


def build_sglang_engine(model_path: str, options: SGLangOptions | None = None, tokenizer=None, seed: int = 0,
                        tp: int = 1) -> SGLangEngine:
    """The engine of this process's tensor-parallel group of size `tp` (its first rank starts SGLang)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return SGLangEngine(model_path, options, tokenizer, seed, group=TPGroup.of_rank(rank, tp))
