"""KV memory in bytes: the value of `rollout.kv_memory`, and what one KV pool entry costs. Plain Python, no torch.

`rollout.kv_memory` says how much memory an engine's KV pool takes, in one of three forms:

- a size with its unit: `64MB`, `1.5GB`, `512KB` (also `MiB`, `GiB`, `KiB`; any case). Units are binary:
  1 KB = 2**10 bytes, 1 MB = 2**20, 1 GB = 2**30, as the engines' own memory lines count;
- a bare number >= 1: megabytes (`rollout.kv_memory=64` is 64 MB);
- a bare number in (0, 1): that fraction of the device memory free when the engine is sized (after the actor is
  built, before the engine loads its weights, which come out of the rest). CUDA only;
- `0`: unset (`rollout.kv_pool_tokens`, or its default, sizes the pool).

A bare number is read by its value, so `0.5` is half the free memory and `1` is one megabyte; half a megabyte is
`0.5MB`. The pool holds `bytes // entry_bytes(...)` entries (one token's keys and values in every layer).
Left out on purpose: decimal units (10**6): the pool is counted in the powers of two the allocators use.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

UNITS = {"kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
SYNTAX = ("a size (64MB, 1.5GB, 512KB), megabytes as a bare number >= 1 (64), a fraction of the free device memory "
          "in (0, 1) (0.3; CUDA), or 0 (unset)")


@dataclass(frozen=True)
class KVMemory:
    """A parsed `rollout.kv_memory`: a number of bytes, or a fraction of the free device memory (neither: unset)."""

    nbytes: int = 0
    fraction: float = 0.0

    @property
    def is_set(self) -> bool:
        return self.nbytes > 0 or self.fraction > 0

    def resolve(self, free_bytes: int | None) -> int:
        """The pool's bytes; `free_bytes`: the device's free memory, needed for a fraction (None: not known)."""
        if self.fraction == 0:
            return self.nbytes
        if free_bytes is None:
            raise ValueError("a fraction of the free device memory needs a CUDA device")
        return int(self.fraction * free_bytes)


def parse_kv_memory(value: object) -> KVMemory:
    """`rollout.kv_memory`'s value (a string from the command line, or a number) as a `KVMemory`; ValueError
    with the accepted forms when it is none of them."""
    text = str(value).strip()
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"{value!r} is not {SYNTAX}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not {SYNTAX}")
    if unit:
        if unit not in UNITS:
            raise ValueError(f"{value!r}: unknown unit {m.group(2)!r}; use KB, MB or GB")
        return KVMemory(nbytes=int(number * UNITS[unit]))
    if number == 0:
        return KVMemory()
    if number < 1:
        return KVMemory(fraction=number)
    return KVMemory(nbytes=int(number * UNITS["mb"]))


def is_kv_memory(value: object) -> bool:
    try:
        parse_kv_memory(value)
    except ValueError:
        return False
    return True


def entry_bytes(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int, scale_bytes: int = 0) -> int:
    """Bytes of one KV pool entry, one token's keys and values in every layer: 2 (K and V) x layers x KV heads x
    (head dim x the bytes of one cached element + the bytes of the scale a quantized pool stores per token and KV
    head). The one place a pool's cost per token is computed (`kv_element_bytes` gives the two sizes of a KV dtype)."""
    return 2 * num_layers * num_kv_heads * (head_dim * element_bytes + scale_bytes)


# `rollout.kv_dtype`: auto (the engine's rollout.dtype), a float dtype, or a quantized one (sparserl/kv/kv_dtype.py).
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8", "fp8")
QUANTIZED_KV = ("int8", "fp8")
_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1, "fp8": 1}
SCALE_BYTES = 4  # the native engine's quantized pools: one float32 scale per (token, KV head), for K and for V


def kv_element_bytes(kv_dtype: str, compute_bytes: int, engine: str = "native") -> tuple[int, int]:
    """(bytes of one cached element, bytes of the scale per token and KV head) of a pool in `kv_dtype`; `auto` is the
    compute dtype's `compute_bytes`. SGLang's fp8 pool stores no per-token scale (one per layer, 1.0 by default)."""
    if kv_dtype == "auto":
        return compute_bytes, 0
    if kv_dtype not in _ELEMENT_BYTES:
        raise ValueError(f"rollout.kv_dtype={kv_dtype!r}: must be one of {', '.join(KV_DTYPES)}")
    scale = SCALE_BYTES if kv_dtype in QUANTIZED_KV and engine == "native" else 0
    return _ELEMENT_BYTES[kv_dtype], scale


def mb(nbytes: float) -> str:
    """Bytes as the start-up lines print them: MB with one decimal (2**20 bytes), KB below one MB."""
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KB"


def at_least(nbytes: float) -> str:
    """The smallest `rollout.kv_memory` in MB, to two decimals, that holds `nbytes`."""
    return f"{math.ceil(nbytes / 2**20 * 100) / 100:g}MB"
