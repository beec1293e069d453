"""The rollout engine of a run: `rollout.*` mapped onto the engine's own options, then the engine built by name.

Each engine is configured by its own dataclass (`NativeOptions`, `SGLangOptions`); this module is the only code
that reads the run's `Config` for an engine, so the engines stay usable as a library without it. `rollout.dtype`,
`rollout.release_weights`, `rollout.kv_memory` / `rollout.kv_pool_tokens` (the pool, in bytes or entries: SGLang's
max_total_tokens; sizing.py) and `rollout.max_num_seqs` set both engines; `rollout.sglang.*` holds what only SGLang
has; `rollout.admission` is the native engine's. Left out on purpose: building an engine for a user-registered name from the config
(such an engine gets `model_path` and `tokenizer` and reads the rest from its own options).
"""
from __future__ import annotations

import dataclasses
import gc

import torch

from sparserl.config import Config
from sparserl.engine_options.sizing import SequenceSize, kv_policy_lines, memory_slots, pool_line
from sparserl.engines.native.options import NativeOptions
from sparserl.engines.protocol import RolloutEngine
from sparserl.engines.registry import build_engine
from sparserl.engines.sglang.options import SGLangOptions
from sparserl.engines.types import SamplingParams
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0
from sparserl.utils.memory import release_free_memory


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    try:
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_strings=tuple(r.stop_strings), n=r.n)
    except (ValueError, TypeError) as e:
        raise UserError(f"rollout: {e}") from None


def pool_slots(cfg: Config, max_prompt_len: int, prompts_per_rank: int, model_path: str | None = None,
               device: torch.device | None = None) -> int:
    """`rollout.kv_memory` in entries of `model_path`'s KV (sizing.py), else `rollout.kv_pool_tokens`, else enough for
    every sequence of a step at its dense worst case (no request ever waits on memory)."""
    if model_path is not None:
        slots = memory_slots(cfg, model_path, device or torch.device("cpu"),
                             SequenceSize(max_prompt_len, cfg.rollout.max_new_tokens))
        if slots is not None:
            return slots
    if cfg.rollout.kv_pool_tokens > 0:
        return cfg.rollout.kv_pool_tokens
    return max(1, prompts_per_rank * cfg.rollout.n) * (max_prompt_len + cfg.rollout.max_new_tokens)


def native_options(cfg: Config, num_slots: int) -> NativeOptions:
    r = cfg.rollout
    return NativeOptions(num_slots=num_slots, max_num_seqs=r.max_num_seqs, max_batch_tokens=r.max_batch_tokens,
                         admission=r.admission, kv=r.kv.with_budget(), release_weights=r.release_weights, quantization=r.quantization,
                         quantize_lm_head=r.quantize_lm_head, rescore_seqs=r.rescore_seqs, decode_cache=r.decode_cache,
                         prepack=r.prepack, cuda_graphs=r.cuda_graphs, kv_dtype=r.kv_dtype)


def sglang_options(cfg: Config, device: torch.device | str = "cpu", num_slots: int = 0) -> SGLangOptions:
    """`rollout.sglang.*` with its `auto` values resolved for this device, and the keys both engines share;
    `num_slots` is the pool a native engine would get for the same run (`pool_slots`: `rollout.kv_memory` in entries,
    or the default), used when `rollout.kv_pool_tokens` is 0."""
    s, r = cfg.rollout.sglang, cfg.rollout
    dev = torch.device(device).type
    on_gpu = dev == "cuda"
    backend = s.attention_backend
    if backend == "auto":
        backend = None if on_gpu else "torch_native"
    kv = r.kv.with_budget()  # the schema node is the engines' policy config (budget=auto: its first step's number)
    return SGLangOptions(
        device=dev,
        dtype=r.dtype,
        kv_cache_dtype=sglang_kv_cache_dtype(r.kv_dtype, r.dtype, on_gpu),
        attention_backend=backend,
        mem_fraction_static=s.mem_fraction_static,
        max_total_tokens=r.kv_pool_tokens or num_slots,
        max_running_requests=r.max_num_seqs,
        chunked_prefill_size=s.chunked_prefill_size,
        cuda_graph=on_gpu and r.cuda_graphs != "off",  # rollout.cuda_graphs (CUDA graphs need CUDA)
        memory_saver=s.memory_saver and on_gpu,  # torch_memory_saver hooks CUDA allocations only
        release_weights=r.release_weights,
        weight_bucket_mb=s.weight_bucket_mb,
        log_level=s.log_level,
        tp_size=cfg.parallel.tp,
        base_gpu_id=torch.cuda.current_device() if on_gpu else 0,
        kv=dataclasses.asdict(kv) if kv.algorithm != "none" else None,
    )


def sglang_kv_cache_dtype(kv_dtype: str, dtype: str, on_gpu: bool) -> str | None:
    """`rollout.kv_dtype` as SGLang's `kv_cache_dtype` (None: its auto, the model's dtype); a UserError for what its
    pool cannot store (int8 is refused when the config loads)."""
    from sparserl.actor.hf import parse_dtype

    if kv_dtype == "auto":
        return None
    if kv_dtype == "fp8":
        if not on_gpu:
            raise UserError("rollout.kv_dtype=fp8 with rollout.engine=sglang needs CUDA (SGLang's fp8_e4m3 KV cache); "
                            "use rollout.engine=native on CPU")
        return "fp8_e4m3"
    if kv_dtype == "bf16":
        return "bf16"
    same = dtype != "auto" and parse_dtype(dtype) == {"fp16": torch.float16, "fp32": torch.float32}.get(kv_dtype)
    if same:
        return None
    raise UserError(f"rollout.kv_dtype={kv_dtype} with rollout.engine=sglang and rollout.dtype={dtype}: SGLang's "
                    "kv_cache_dtype takes auto (the model's dtype), bf16 or fp8_e4m3; use rollout.kv_dtype=auto")


def build_rollout_engine(cfg: Config, model_path: str, tokenizer, device: torch.device, num_slots: int,
                         seed: int, longest: SequenceSize | None = None) -> RolloutEngine:
    """The rollout engine, started after the device memory the actor's build left cached is given back (SGLang
    sizes its KV pool from the free memory it measures once, at start-up); says the pool it got and, given the
    `longest` sequence, how many of them it holds (dense, and compressed with compression on)."""
    gc.collect()
    release_free_memory()
    engine = _build(cfg, model_path, tokenizer, device, num_slots, seed)
    st = engine.stats()
    free = f" ({torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB of the device free after)" if device.type == "cuda" else ""
    if longest is not None and st.pool_slots and st.kv_bytes_per_slot:
        log0(f"rollout engine {cfg.rollout.engine}: {pool_line(cfg, st.pool_slots, st.kv_bytes_per_slot, longest)} per "
             f"engine{free}")
        for line in kv_policy_lines(cfg, longest):
            log0(line)
    else:
        log0(f"rollout engine {cfg.rollout.engine}: KV pool {st.pool_slots} tokens x {st.kv_bytes_per_slot} B = "
             f"{st.pool_slots * st.kv_bytes_per_slot / 2**30:.3f} GiB per engine{free}")
    return engine


def _build(cfg: Config, model_path: str, tokenizer, device: torch.device, num_slots: int, seed: int) -> RolloutEngine:
    if cfg.rollout.engine == "native":
        from sparserl.actor.hf import load_model

        model = load_model(model_path, cfg.rollout.dtype, device)
        return build_engine("native", model=model, tokenizer=tokenizer, options=native_options(cfg, num_slots), seed=seed)
    if cfg.rollout.engine == "sglang":
        return build_engine("sglang", model_path=model_path, options=sglang_options(cfg, device, num_slots),
                            tokenizer=tokenizer, seed=seed, tp=cfg.parallel.tp)
    return build_engine(cfg.rollout.engine, model_path=model_path, tokenizer=tokenizer, seed=seed)
