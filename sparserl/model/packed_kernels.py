"""One attention call per layer for a packed micro-batch without a KV cache (the actor's forwards).

`packed_attention` (model/attention.py) used to attend span by span: one SDPA call per packed sequence per layer.
A response span with a shared prompt (`Span.prefix`) passed a boolean mask, and with GQA SDPA has no fused kernel
for a mask (flash refuses masks, memory-efficient refuses GQA): those calls ran the math backend, which upcasts to
fp32 and materializes the (H, n, p + n) scores. On CUDA the whole micro-batch is now one call per layer:

- `flash_attn`: flash-attn's `flash_attn_varlen_func`, where that package imports (fp16 / bf16).
- `varlen`: torch's `torch.nn.attention.varlen.varlen_attn` (the same flash kernel inside torch; fp16 / bf16 on
  sm80 and newer). Its keyword set changed between torch releases (`is_causal` vs `window_size`, `enable_gqa`,
  `scale`), so the call is built from the signature found at run time.
- `flex`: `flex_attention` (compiled on CUDA) with a document + prefix block mask; the only one of the three that
  takes fp32, and the fallback where neither varlen kernel is there.

The varlen layout: segment i holds span i's rows as queries and, as keys/values, its prefix span's rows followed by
its own rows (one `index_select` per layer, skipped when no span has a prefix). Causality is aligned bottom-right
(flash's rule when a segment has more keys than queries): query j of a segment of n queries and p + n keys sees keys
0..p + j, that is the whole shared prompt and itself causally; a span without a prefix is plain causal. The block
mask says the same thing per row: the keys of its own span at or before it, and every row of its span's prefix.

What a micro-batch needs (cu_seqlens, the gather index, the block mask) is built once, from span boundaries the
host knows, with one host-to-device copy, and cached on the forward context (`ForwardContext.packed`) so every
layer, and the recomputation of activation checkpointing, reuses it.

`choose_packed_backend` picks: on CUDA, fp16 / bf16 go to flash_attn, else varlen, else flex; fp32 goes to flex. It
never picks the per-span path on CUDA, since that path falls to SDPA's math backend for GQA with shared prompts.
Elsewhere (CPU) it keeps the per-span path (`spans`): flex has no backward on CPU and its eager form materializes
the full score matrix. `SPARSERL_PACKED_BACKEND` (or `force_backend(...)`) overrides the choice, which is how the CPU
tests run the flex forward and `varlen_reference`, a per-segment SDPA over the varlen layout that checks the layout
without a flash kernel.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

BACKENDS = ("spans", "flash_attn", "varlen", "flex", "varlen_reference")
SINGLE_CALL = ("flash_attn", "varlen", "flex")
FORCE_ENV = "SPARSERL_PACKED_BACKEND"
BLOCK = 128  # flex's sparse block size
_forced: str | None = None


@contextlib.contextmanager
def force_backend(name: str | None) -> Iterator[None]:
    """Run the packed attention through `name` (one of BACKENDS) inside the block; None restores the choice."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {name!r}; one of {BACKENDS}")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


def forced_backend() -> str | None:
    name = _forced or os.environ.get(FORCE_ENV) or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{FORCE_ENV}={name!r}: one of {BACKENDS}")
    return name


@functools.lru_cache(maxsize=None)
def flash_attn_available() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # not installed, or built for another torch / CUDA
        return False
    return True


def torch_varlen_available(device: torch.device) -> bool:
    """torch's varlen_attn exists and runs its flash kernel on the device (sm80 and newer). Where a torch release
    routes it to cuDNN instead, it is left out: that path refuses GQA and its causal alignment is not flash's."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    cudnn = getattr(varlen, "_should_use_cudnn", None)
    try:
        return not (cudnn is not None and cudnn(torch.device(device).index or 0))
    except Exception:  # a private helper whose form changed: trust the flash default
        return True


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def choose_packed_backend(device: torch.device, dtype: torch.dtype, *, flash_attn: bool | None = None,
                          torch_varlen: bool | None = None, flex: bool | None = None) -> str:
    """The packed attention's backend for a micro-batch on `device` in `dtype` (availability is detected unless
    given). On CUDA always one call per layer, never SDPA's math backend; elsewhere the per-span path."""
    forced = forced_backend()
    if forced is not None:
        return forced
    device = torch.device(device)
    if device.type != "cuda":
        return "spans"
    if dtype in (torch.float16, torch.bfloat16):
        if flash_attn if flash_attn is not None else flash_attn_available():
            return "flash_attn"
        if torch_varlen if torch_varlen is not None else torch_varlen_available(device):
            return "varlen"
    if flex if flex is not None else flex_available():
        return "flex"
    raise RuntimeError(f"no single-call packed attention for {dtype} on {device}: install flash-attn or use a torch "
                       "with torch.nn.attention.flex_attention")


@dataclass
class PackedLayout:
    """What one micro-batch's packed attention needs in every layer (see the module docstring)."""

    backend: str
    max_q: int = 0
    max_k: int = 0
    cu_q: torch.Tensor | None = None  # (N + 1,) int32: query segment offsets
    cu_k: torch.Tensor | None = None  # (N + 1,) int32: key segment offsets in the gathered keys
    kv_index: torch.Tensor | None = None  # (Tk,) long: packed rows gathered as keys/values; None = the rows as they are
    block_mask: object | None = None  # flex: the document + prefix BlockMask


def _row_bounds(spans) -> tuple[list[int], ...]:
    """Per span: start, end, the (start, end) of its prefix span ((0, 0) for none) and its index (-1 for none),
    checking that the spans tile the rows in order."""
    starts, ends, p0, p1, pre_of = [], [], [], [], []
    at = spans[0].start if spans else 0
    for i, sp in enumerate(spans):
        if sp.start != at or sp.end < sp.start:
            raise ValueError(f"span {i} [{sp.start}, {sp.end}) does not continue the packed rows at {at}")
        if sp.prefix is not None and not 0 <= sp.prefix < i:
            raise ValueError(f"span {i} has prefix {sp.prefix}: a prefix must be an earlier span")
        at = sp.end
        pre = spans[sp.prefix] if sp.prefix is not None else None
        starts.append(sp.start)
        ends.append(sp.end)
        p0.append(pre.start if pre is not None else 0)
        p1.append(pre.end if pre is not None else 0)
        pre_of.append(-1 if sp.prefix is None else sp.prefix)
    return starts, ends, p0, p1, pre_of


def build_layout(spans: Sequence, device: torch.device, backend: str) -> PackedLayout:
    """The layout of packed rows tiled by `spans` (model.attention.Span, no cache) for `backend`."""
    if backend == "spans":
        return PackedLayout(backend)
    starts, ends, p0, p1, pre_of = (torch.tensor(x, dtype=torch.long) for x in _row_bounds(spans))
    base = int(starts[0]) if len(starts) else 0
    qlen, plen = ends - starts, p1 - p0
    if backend == "flex":
        return _flex_layout(starts - base, qlen, p0 - base, plen, pre_of, device)
    klen = plen + qlen
    zero = torch.zeros(1, dtype=torch.long)
    cu_q, cu_k = torch.cat([zero, qlen.cumsum(0)]), torch.cat([zero, klen.cumsum(0)])
    parts = [cu_q, cu_k]
    if bool((plen > 0).any()):
        # Segment i's keys: rows [p0, p1) then [start, end): each piece is a run of consecutive rows.
        run_start = torch.stack([p0, starts], 1).reshape(-1) - base
        run_len = torch.stack([plen, qlen], 1).reshape(-1)
        run_off = torch.cat([zero, run_len.cumsum(0)[:-1]])
        total = int(run_len.sum())
        parts.append(torch.arange(total) + torch.repeat_interleave(run_start - run_off, run_len, output_size=total))
    dev = torch.cat(parts).to(device, non_blocking=True)  # one copy per micro-batch
    n = len(qlen) + 1
    return PackedLayout(backend, int(qlen.max()) if n > 1 else 0, int(klen.max()) if n > 1 else 0,
                        dev[:n].to(torch.int32), dev[n: 2 * n].to(torch.int32), dev[2 * n:] if len(parts) == 3 else None)


def _flex_layout(starts, qlen, p0, plen, pre_of, device) -> PackedLayout:
    """The block mask of the document + prefix rule, its blocks classified from per-row key intervals (no (T, T)
    mask is ever built): a row sees [own span start, itself] and [prefix start, prefix end)."""
    from torch.nn.attention.flex_attention import BlockMask

    T = int(qlen.sum())
    span_of = torch.repeat_interleave(torch.arange(len(qlen)), qlen, output_size=T)
    rows = torch.arange(T)
    lo_own, hi_own = starts[span_of], rows + 1
    lo_pre, hi_pre = p0[span_of], (p0 + plen)[span_of]
    nb = (T + BLOCK - 1) // BLOCK
    blo = torch.arange(nb) * BLOCK
    bhi = torch.clamp(blo + BLOCK, max=T)

    def overlap(lo, hi):  # (T, nb) keys of each block inside [lo, hi) per row
        return (torch.minimum(hi[:, None], bhi[None]) - torch.maximum(lo[:, None], blo[None])).clamp(min=0)

    seen = overlap(lo_own, hi_own) + overlap(lo_pre, hi_pre)
    pad = nb * BLOCK - T
    any_ = F.pad(seen, (0, 0, 0, pad)).view(nb, BLOCK, nb).amax(1) > 0
    width = bhi - blo
    full = (F.pad(seen, (0, 0, 0, pad)).view(nb, BLOCK, nb) >= width).all(1)  # padding rows: never full, as flex's own
    partial = any_ & ~full

    def blocks(m):
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return m.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    host = torch.cat([x.reshape(-1) for x in (*blocks(partial), *blocks(full))]).to(torch.long)
    rowinfo = torch.cat([span_of, pre_of[span_of]])
    dev = torch.cat([host, rowinfo]).to(device, non_blocking=True)  # one copy per micro-batch
    n_num, n_idx = nb, nb * nb
    cut = [n_num, n_idx, n_num, n_idx, T, T]
    kv_num, kv_idx, full_num, full_idx, span_d, pre_d = torch.split(dev, cut)

    def mask_mod(b, h, q, k):
        return ((span_d[k] == span_d[q]) & (k <= q)) | (span_d[k] == pre_d[q])

    shape = lambda x, *s: x.to(torch.int32).view(1, 1, *s)  # noqa: E731
    mask = BlockMask.from_kv_blocks(shape(kv_num, nb), shape(kv_idx, nb, nb), shape(full_num, nb),
                                    shape(full_idx, nb, nb), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, T))
    return PackedLayout("flex", block_mask=mask)


@functools.lru_cache(maxsize=None)
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q, k, v, lay: PackedLayout, scale):
    from torch.nn.attention.varlen import varlen_attn

    params, kw = _varlen_params(), {}
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None:  # older torch: fold the scale into the queries
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned bottom-right
    else:
        kw["is_causal"] = True
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kw["enable_gqa"] = True  # releases without the flag pass GQA straight to the flash kernel, which takes it
    return varlen_attn(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, **kw)


def varlen_reference(q, k, v, cu_q: Sequence[int], cu_k: Sequence[int], scale) -> torch.Tensor:
    """What a varlen kernel computes, one SDPA call per segment: causal aligned bottom-right (query j of n sees keys
    0..m - n + j of m). For tests, and for checking a layout without a flash kernel."""
    out = []
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        n, m = b - a, d - c
        mask = torch.arange(m, device=q.device)[None] <= torch.arange(n, device=q.device)[:, None] + (m - n)
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])
        out.append(o[0].transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attend(lay: PackedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The packed rows' attention in one call: q (T, H, D), k / v (T, H_kv, D) -> (T, H, D)."""
    if lay.backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        fn = _compiled_flex() if q.is_cuda else flex_attention
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
        out = fn(qs, ks, vs, block_mask=lay.block_mask, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])
        return out[0].transpose(0, 1)
    if lay.kv_index is not None:
        k, v = k.index_select(0, lay.kv_index), v.index_select(0, lay.kv_index)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if lay.backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, softmax_scale=scale, causal=True)
    if lay.backend == "varlen":
        return _torch_varlen(q, k, v, lay, scale)
    if lay.backend == "varlen_reference":
        return varlen_reference(q, k, v, lay.cu_q.tolist(), lay.cu_k.tolist(), scale)
    raise ValueError(f"packed attention backend {lay.backend!r} has no single call")
