"""The element type of a KV pool (`rollout.kv_dtype`) and the one accessor every reader and writer of a pool goes through.

A pool is one tensor per layer for keys and one for values, (slots, H_kv, D). Its dtype is a property of the pool,
not of the model: `KVFormat` says what an entry is stored as, and a layer of a pool whose storage is not the
model's compute dtype is a `KVStore` instead of a plain tensor:

- `int8`: codes in [-127, 127] and one float32 scale per (token, KV head), amax / 127 of that row's D elements;
- `fp8`: float8 e4m3 with the same per-(token, KV head) float32 scale, amax / 448 (so no row saturates); the codes
  are kept as their bytes (uint8), since indexing kernels for float8 are missing on CPU (only the casts are needed);
- `bf16` / `fp16` / `fp32` other than the compute dtype: the entries cast on write and cast back on read.

A pool in the compute dtype (`auto`, or the compute dtype's own name) stays a plain tensor and every accessor is
then the indexing op the engines ran before, so results are bitwise those of a pool without a `rollout.kv_dtype`.

The accessor: `write_entries` (quantize and store new keys or values at their slots), `read_entries` (gather
entries and dequantize them to the compute dtype: what attention and the compaction's scoring see), and
`entry_parts` (the tensors an entry occupies: a compaction or a fork moves codes and scales together, with one
indexing pattern for both). Attention over a quantized pool is attention over its dequantized values.
Left out on purpose: asymmetric (zero-point) codes, per-channel scales, int4, and kernels that read codes without
dequantizing first (the Triton decode kernel reads float pools only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.utils.kv_memory import KV_DTYPES, QUANTIZED_KV, kv_element_bytes

FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest code: int8's symmetric range, float8 e4m3fn's largest finite value
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}  # fp8: the e4m3fn bytes
FP8 = torch.float8_e4m3fn


def quantize(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """(N, H, D) floats -> codes (N, H, D) in `CODE_DTYPES[kind]` and scales (N, H) float32, one per row of D.
    Dequantized, each element is within half a code step (scale / 2) of its value for int8, and within e4m3's
    relative rounding (2**-4 of its magnitude) for fp8."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX[kind]  # (N, H)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, scale 0
    y = xf / safe[..., None]
    if kind == "int8":
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(FP8).view(torch.uint8)
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor, kind: str, dtype: torch.dtype) -> Tensor:
    """codes (..., D) and scales (...) -> values (..., D) in `dtype`; the product in float32."""
    values = codes.view(FP8).float() if kind == "fp8" else codes.float()
    return (values * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class KVFormat:
    """What a pool entry is stored as. `name`: `rollout.kv_dtype` (auto: the compute dtype)."""

    name: str
    compute: torch.dtype  # what reads return: the model's dtype

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED_KV

    @property
    def plain(self) -> bool:
        """Stored as the compute dtype: the pool is a plain tensor."""
        return self.name == "auto" or (not self.quantized and FLOATS[self.name] == self.compute)

    @property
    def storage(self) -> torch.dtype:
        if self.quantized:
            return CODE_DTYPES[self.name]
        return self.compute if self.name == "auto" else FLOATS[self.name]

    def element_and_scale_bytes(self) -> tuple[int, int]:
        """(bytes of one cached element, bytes of the scale stored per (token, KV head) row)."""
        return kv_element_bytes(self.name, self.compute.itemsize)

    def new_layer(self, shape: tuple[int, int, int], device: torch.device, zero: bool) -> Tensor | KVStore:
        """One layer's keys or values, (slots, H_kv, D); `zero`: filled with zeros, else left unwritten."""
        alloc = torch.zeros if zero else torch.empty
        data = alloc(shape, dtype=self.storage, device=device)
        if self.plain:
            return data
        scale = alloc(shape[:2], dtype=torch.float32, device=device) if self.quantized else None
        return KVStore(data, scale, self)


def resolve_kv_dtype(name: str, compute: torch.dtype) -> KVFormat:
    """`rollout.kv_dtype` for a model computing in `compute`; ValueError naming the key for an unknown value."""
    if name not in KV_DTYPES:
        raise ValueError(f"rollout.kv_dtype={name!r}: must be one of {', '.join(KV_DTYPES)}")
    return KVFormat(name, compute)


class KVStore:
    """One layer's keys (or values) of a pool not stored in the compute dtype: `data` (slots, H_kv, D) in the storage
    dtype, and for int8 / fp8 `scale` (slots, H_kv) float32."""

    def __init__(self, data: Tensor, scale: Tensor | None, fmt: KVFormat) -> None:
        self.data, self.scale, self.fmt = data, scale, fmt

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:  # what reads return
        return self.fmt.compute

    @property
    def device(self) -> torch.device:
        return self.data.device

    def parts(self) -> tuple[Tensor, ...]:
        return (self.data,) if self.scale is None else (self.data, self.scale)

    def write(self, index: Tensor, x: Tensor) -> None:
        if self.scale is None:
            self.data.index_copy_(0, index, x.to(self.data.dtype))
            return
        codes, scale = quantize(x, self.fmt.name)
        self.data.index_copy_(0, index, codes)
        self.scale.index_copy_(0, index, scale)

    def read(self, index: Tensor) -> Tensor:
        data = self.data.index_select(0, index)
        if self.scale is None:
            return data.to(self.fmt.compute)
        return dequantize(data, self.scale.index_select(0, index), self.fmt.name, self.fmt.compute)

    def nbytes(self, slots: int | None = None) -> int:
        """Bytes of the first `slots` entries (all of them: None)."""
        return sum(t[:slots].nbytes for t in self.parts())


# ---------------------------------------------------------------------------------------------- the accessor
def write_entries(buf: Tensor | KVStore, index: Tensor, x: Tensor) -> None:
    """Store `x` (N, H_kv, D), in the compute dtype, at slots `index` (N,)."""
    if isinstance(buf, KVStore):
        buf.write(index, x)
    else:
        buf.index_copy_(0, index, x.to(buf.dtype))


def read_entries(buf: Tensor | KVStore, index: Tensor) -> Tensor:
    """The entries at slots `index` (any shape), dequantized: index.shape + (H_kv, D), in the compute dtype."""
    flat = index.reshape(-1)
    out = buf.read(flat) if isinstance(buf, KVStore) else buf.index_select(0, flat)
    return out if index.dim() == 1 else out.view(*index.shape, *out.shape[1:])


def entry_parts(buf: Tensor | KVStore) -> tuple[Tensor, ...]:
    """The tensors an entry occupies, each indexed by slot first (codes (S, H_kv, D), scales (S, H_kv)): what moves
    when entries move."""
    return buf.parts() if isinstance(buf, KVStore) else (buf,)
