"""What the native engine is started with: `NativeOptions`.

The trainer's setup (sparserl/engine_options/build.py) maps the run's `rollout.*` keys onto these fields; library users
build them directly, or pass the fields as keywords to `NativeEngine`. Left out on purpose: the device and the dtype
(those of the model the engine is given) and the seed (`NativeEngine(seed=...)`, then `set_seed` per step).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.kv import KVPolicyConfig


@dataclass(frozen=True)
class NativeOptions:
    num_slots: int = 65536  # KV pool slots per layer
    max_num_seqs: int = 256  # sequences decoding at once
    max_batch_tokens: int = 8192  # tokens per forward: new prompts are prefilled while they fit
    admission: str = "optimistic"  # optimistic | reserve: admit on the current need or the worst case (scheduler.py)
    admission_watermark: float = 0.01  # optimistic: share of the pool an admission leaves free
    kv: KVPolicyConfig | None = None  # compression policy; None or algorithm=none keeps a dense cache
    release_weights: bool = False  # sleep() also drops the weights (the actor pushes fresh ones after every update)
    quantization: str = "none"  # none | int8 | w8a8 | fp8 (quantize.py)
    quant_kernel: str = "auto"  # the int8 matmul kernel (quantize.py)
    quantize_lm_head: bool = False
    rescore_seqs: int = 0  # measure-only: sequences per generate() re-scored with a dense cache (rescore.py)
    decode_cache: str = "auto"  # on | off | auto: contiguous decode K/V copies (decode_cache.py)
    prepack: str = "auto"  # auto | on | off | onednn | mkl: linear weights packed for the decode GEMMs (prepack.py)
    cuda_graphs: str = "auto"  # on | off | auto (= on for CUDA): decode-only steps over static buffers, captured on CUDA
    kv_dtype: str = "auto"  # auto | bf16 | fp16 | fp32 | int8 | fp8: what the KV pool stores (sparserl/kv/kv_dtype.py)
