"""What the in-process SGLang engine is started with: `SGLangOptions` (the trainer's setup, sparserl/engine_options/build.py,
maps the run's config onto them) and the SGLang server arguments they stand for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class SGLangOptions:
    """What an engine is started with: resolved values (no `auto`), for one device."""

    device: str = "cpu"  # cpu | cuda
    dtype: str = "bfloat16"
    kv_cache_dtype: str | None = None  # SGLang's kv_cache_dtype (fp8_e4m3, bf16); None: its auto, the model's dtype
    attention_backend: str | None = "torch_native"  # None: SGLang's choice
    mem_fraction_static: float = 0.5
    max_total_tokens: int = 0  # 0: sized from mem_fraction_static
    max_running_requests: int = 256
    chunked_prefill_size: int = 4096  # 0: no chunking
    cuda_graph: bool = False
    memory_saver: bool = False
    release_weights: bool = True
    weight_bucket_mb: float = 256
    log_level: str = "error"
    tp_size: int = 1
    base_gpu_id: int = 0
    # KV compression (`rollout.kv.*` as a dict of `KVPolicyConfig` fields); None: dense. With a policy the engine
    # runs the `sparserl_kv` attention backend over `attention_backend` (see kv_backend.py).
    kv: dict | None = None
    kv_trace: bool = False  # report kept logical positions per compaction and each token's noise position (tests)
    kv_count_syncs: bool = False  # count host syncs of the compression bookkeeping (tests; slows every step)

    @property
    def base_attention_backend(self) -> str:
        return self.attention_backend or ("torch_native" if self.device == "cpu" else "triton")

    def server_args(self, model_path: str, seed: int) -> dict[str, Any]:
        args: dict[str, Any] = dict(
            model_path=model_path, device=self.device, dtype=self.dtype, tp_size=self.tp_size, random_seed=seed,
            mem_fraction_static=self.mem_fraction_static, max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size or -1, disable_cuda_graph=not self.cuda_graph,
            enable_memory_saver=self.memory_saver, log_level=self.log_level,
            # Idle, the scheduler would spin a core at 100% while the colocated actor trains.
            sleep_on_idle=True,
            # sparserl's sampler stands in for this backend and reads each request's settings from custom_params
            # (kept on the request by SGLang; no custom logit processor, which would cost a mask and copies per step).
            # Dense engines keep SGLang's overlap scheduler and, on CUDA, its graphs.
            sampling_backend="pytorch",
        )
        if self.max_total_tokens:
            args["max_total_tokens"] = self.max_total_tokens
        if self.kv_cache_dtype:
            args["kv_cache_dtype"] = self.kv_cache_dtype
        if self.attention_backend:
            args["attention_backend"] = self.attention_backend
        if self.kv is not None:
            # Compaction frees slots a prefix tree would share, must run between a step's sampling and the next
            # step's preparation, and works on single-token pages. Decode CUDA graphs stay as `cuda_graph` says: the
            # backend's decode state (capture index, position shift) lives in static buffers written before replay;
            # a prefill's capture index is planned per forward, so prefill graphs are off.
            args.update(attention_backend="sparserl_kv", disable_radix_cache=True, disable_overlap_schedule=True,
                        enable_mixed_chunk=False, page_size=1, disable_prefill_cuda_graph=True)
        if self.device == "cuda":
            args["base_gpu_id"] = self.base_gpu_id
        else:
            args["disable_cuda_graph"] = True  # CUDA graphs need CUDA
        return args
