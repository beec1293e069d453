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
kernel (no triton, a CPU tensor without the interpreter, or a CUDA device where the first launch failed)
`paged_decode_attention` falls back to it, so a caller never needs a second code path;
`kernel_available(device)` says which one runs. On CUDA it probes once per device and process
(`launch_problem`): triton builds its launcher with the host's C compiler and Python's headers at the first
launch, not at import, so a machine without gcc or Python.h imports triton and then fails in the first forward.
`launches` lists the launches of a call without running them; `compile_check.py` compiles them for GPU targets
on a machine without one (the CI test and the table in docs/gpu.md).

Left out on purpose: more than one query per row (prefill and speculative decoding go through SDPA), head
sizes that are not a power of two in [16, 256] (a clear ValueError), attention sinks, soft-capping, sliding
windows and ALiBi (no supported model uses them), fp8 pools, and validating slot values (that needs a host
sync: slots must lie in [0, S)).
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional: the reference covers every call
    triton = None
    tl = None

# triton.jit reads TRITON_INTERPRET when it decorates, so the mode is fixed at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


log = logging.getLogger(__name__)


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernel runs on `device`: triton imports, and the device is CPU with the interpreter
    (TRITON_INTERPRET=1 set before this module was imported), or CUDA where the probe at first use passed
    (`launch_problem`)."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return _INTERPRETED
    return device.type == "cuda" and launch_problem(device) is None


@functools.cache
def launch_problem(device: torch.device) -> str | None:
    """Why the kernel cannot run on the CUDA `device`, or None when it can; probed once per device and process, and
    a problem is logged in one line. The probe builds a tiny extension module with triton's own build step (the
    C compiler and Python.h its launcher needs), then launches both kernels once on a tiny case and compares them
    with the reference."""
    problem = build_problem()
    if problem is None:
        try:
            problem = _tiny_launch_problem(device)
        except Exception as e:  # whatever the first launch raises (no device, driver, compile) means: not here
            problem = f"the first launch raised {_first_line(e)}"
    if problem is not None:
        log.warning("paged decode kernel off on %s (%s): decode attention takes the SDPA path", device, problem)
    return problem


_PROBE_C = """#include <Python.h>
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, "sparserl_triton_probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_sparserl_triton_probe(void) { return PyModule_Create(&probe); }
"""


def build_problem() -> str | None:
    """Why triton's build step (`triton.runtime.build._build`: the C compiler from $CC or PATH, Python's headers)
    fails on this host, or None when a tiny extension module builds. Not cached by triton: it runs every time."""
    from triton.runtime import build

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sparserl_triton_probe.c"
        src.write_text(_PROBE_C)
        try:
            build._build("sparserl_triton_probe", str(src), tmp, [], [], [], [])
        except Exception as e:
            return f"triton's build step failed, {_first_line(e)} (it needs a C compiler and Python.h)"
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _tiny_launch_problem(device: torch.device) -> str | None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device) for shape in ((1, 2, 16), (64, 1, 16), (64, 1, 16)))
    table = torch.arange(64, dtype=torch.int32).flip(0)[None].to(device)
    lengths = torch.tensor([50], device=device)
    with torch.cuda.device(device):
        out, plan = launches(q, k, v, table, lengths, block_n=16, split_len=16)  # 4 splits: both kernels
        for launch in plan:
            launch.kernel[launch.grid](*launch.args, **launch.constants)
    err = (out - reference_decode_attention(q, k, v, table, lengths)).abs().max().item()
    return None if err < 1e-3 else f"a tiny launch differs from the reference by {err:.3g}"


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


if triton is not None:

    # split_len and num_splits stay runtime integers (not constexpr, not specialized on their values), so that the
    # batch-size buckets and table widths of the static step (which move them) share one compiled kernel per
    # (dtype, D, G, one split or several) instead of one per combination.
    @triton.jit(do_not_specialize=["split_len", "num_splits"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, part_ptr, lse_ptr, out_ptr, scale, W, split_len,
                      num_splits, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                      stride_tw, stride_lb, stride_lh, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr):
        """One (row, KV head, split): online softmax of the G query heads over the split's entries. With one
        split it writes the normalized output; otherwise the partial output and its log-sum-exp. DOT_FP32 runs
        the dots in fp32 (the interpreter's tl.dot multiplies bf16 bit patterns as integers)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + b * stride_lb + kvh * stride_lh).to(tl.int32)
        length = tl.minimum(tl.maximum(length, 0), W)
        start = split * split_len
        end = tl.minimum(start + split_len, length)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        heads = kvh * G + offs_g
        q_mask = offs_g[:, None] < G
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        else:
            q = q.to(k_ptr.dtype.element_ty)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):  # bounds from the lengths: no work past a row's end
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(table_ptr + b * stride_tb + offs_n * stride_tw, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=n_mask[:, None], other=0.0)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=n_mask[:, None], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (G_PAD, BLOCK_N) fp32
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or row) stays zero
        if ONE_SPLIT:
            tl.store(out_ptr + (b * G * tl.num_programs(1) + heads[:, None]) * D + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            row = (b * G * tl.num_programs(1) + heads) * num_splits + split  # partials (B, H, num_splits, D)
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], o, mask=q_mask)
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + row, lse, mask=offs_g < G)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
        """One (row, query head): weight the splits' outputs by exp(lse - max lse); zero when all are empty.
        The splits are read SPLIT_BLOCK at a time (a first pass for the max, a second to accumulate), so the
        registers do not grow with their number: a (num_splits, D) tile in registers spilled at 256 splits."""
        bh = tl.program_id(0)
        offs_s = tl.arange(0, SPLIT_BLOCK)
        offs_d = tl.arange(0, D)
        base = bh * num_splits
        m_vec = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            s = s0 + offs_s
            m_vec = tl.maximum(m_vec, tl.load(lse_ptr + base + s, mask=s < num_splits, other=float("-inf")))
        m = tl.max(m_vec, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight is exp(-inf) = 0
        acc = tl.zeros([D], tl.float32)
        w_sum = tl.zeros([SPLIT_BLOCK], tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            s = s0 + offs_s
            s_mask = s < num_splits
            w = tl.exp(tl.load(lse_ptr + base + s, mask=s_mask, other=float("-inf")) - m)
            part = tl.load(part_ptr + (base + s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
            acc += tl.sum(part * w[:, None], 0)
            w_sum += w
        total = tl.sum(w_sum, 0)
        o = acc / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + bh * D + offs_d, o.to(out_ptr.dtype.element_ty))


MERGE_SPLIT_BLOCK = 16  # splits the merge reads per step: a (16, D) fp32 tile, 32 registers a thread at D = 256


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _launch_config(B: int, hkv: int, D: int, W: int, block_n, split_len, elt_bytes: int = 2) -> tuple[int, int, int]:
    """(block_n, split_len, num_splits) from the shapes only. Splits are added until B * H_kv * splits
    programs fill a large GPU (about 512), but each split keeps at least four blocks of work. fp32 pools
    (`elt_bytes` 4) take half the slots per block: their K/V tiles spilled registers at sm_90 otherwise
    (`python -m sparserl.kernels.compile_check`)."""
    if block_n is None:
        block_n = 64 if D <= 64 else (32 if D <= 128 else 16)
        if elt_bytes > 2:
            block_n = max(16, block_n // 2)
    if block_n < 16 or block_n != _pow2(block_n):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}")
    if split_len is None:
        wanted = max(1, -(-512 // (B * hkv)))
        split_len = max(4 * block_n, -(-W // wanted))
    split_len = -(-max(split_len, 1) // block_n) * block_n  # a multiple of block_n
    return block_n, split_len, max(1, -(-W // split_len))


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: `kernel[grid](*args, **constants)` (constants: the constexprs, and launch
    options such as num_warps). The compile check (`sparserl/kernels/compile_check.py`) compiles exactly these for
    a GPU target without launching them."""

    kernel: object  # a triton JITFunction (the interpreter's function under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple
    constants: dict


def launches(q, k_pool, v_pool, slot_table, lengths, scale=None, *, block_n=None,
             split_len=None) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor of a `paged_decode_attention` call and the launches that fill it (not run). Raises the
    call's ValueErrors (shapes, head size, dtypes, devices)."""
    _check(q, k_pool, v_pool, slot_table, lengths)
    B, H, D = q.shape
    hkv, W = k_pool.shape[1], slot_table.shape[1]
    if D < 16 or D > 256 or D != _pow2(D):
        raise ValueError(f"the paged decode kernel needs a head size that is a power of two in [16, 256]; got {D}")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or k_pool.dtype != v_pool.dtype:
        raise ValueError("k_pool and v_pool must share a dtype and be contiguous in the head dimension")
    if k_pool.device != q.device or slot_table.device != q.device or lengths.device != q.device:
        raise ValueError(f"q, the pools, slot_table and lengths must be on one device; q is on {q.device}")
    block_n, split_len, num_splits = _launch_config(B, hkv, D, W, block_n, split_len, k_pool.element_size())
    q = q.contiguous()
    out = torch.empty_like(q)
    G = H // hkv
    if num_splits == 1:
        part = lse = out  # unused by the kernel with one split
    else:
        part = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    stride_lh = lengths.stride(1) if lengths.dim() == 2 else 0
    g_pad = max(16, _pow2(G))
    # Eight warps where one program's (G_PAD, D) tile reaches 16 KB (fp32 MQA at D >= 128, bf16 MQA at D = 256, fp32
    # at D = 256): at four, fp32 MQA spilled at sm_90 (`python -m sparserl.kernels.compile_check`).
    warps = 8 if g_pad * D * k_pool.element_size() >= 16384 else 4
    plan = [Launch(_split_kernel, (B, hkv, num_splits), (
        q, k_pool, v_pool, slot_table, lengths, part, lse, out, float(D**-0.5 if scale is None else scale), W,
        split_len, num_splits, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), slot_table.stride(0), slot_table.stride(1), lengths.stride(0), stride_lh),
        dict(G=G, G_PAD=g_pad, D=D, BLOCK_N=block_n, ONE_SPLIT=num_splits == 1,
             DOT_FP32=_INTERPRETED and k_pool.dtype == torch.bfloat16, num_warps=warps))]
    if num_splits > 1:
        plan.append(Launch(_merge_kernel, (B * H,), (part, lse, out, num_splits),
                           dict(D=D, SPLIT_BLOCK=MERGE_SPLIT_BLOCK)))
    return out, plan


def paged_decode_attention(q, k_pool, v_pool, slot_table, lengths, scale=None, *, block_n=None,
                           split_len=None) -> torch.Tensor:
    """Decode attention of `q` (B, H, D) over the pool slots of each row (see the module docstring for the
    contract). `block_n` (slots per inner step, a power of two >= 16) and `split_len` (entries per split, rounded
    up to a multiple of block_n) override the defaults, which depend on the shapes only (`_launch_config`)."""
    _check(q, k_pool, v_pool, slot_table, lengths)
    if not kernel_available(q.device):
        return reference_decode_attention(q, k_pool, v_pool, slot_table, lengths, scale)
    out, plan = launches(q, k_pool, v_pool, slot_table, lengths, scale, block_n=block_n, split_len=split_len)
    for launch in plan:
        launch.kernel[launch.grid](*launch.args, **launch.constants)
    return out
