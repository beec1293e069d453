"""Ring attention over a context-parallel group: the block compute and the ring schedule (the layout it runs on is
`actor/context_parallel.py`'s zigzag plan; docs/context_parallel.md has the design).

Each rank keeps its queries; the keys/values travel around the ring, rank r sending to r+1 and receiving from r-1,
so at step s rank r holds the block of rank (r - s) mod C. Each (query block, key block) pair is computed on the rows
and columns that have any visible entry only, by `block_attention`, which returns the block's output and
log-sum-exp (fp32); blocks merge by their log-sum-exp. The next block's transfer is posted before the current block
is computed. Backward recomputes each block's probabilities from the final log-sum-exp (the flash-attention
backward): dQ stays home, dK/dV accumulate in fp32 buffers that travel with the keys/values and, after one last hop,
reach their owner.

The block compute runs in query tiles whose mask is built on the fly from the plan's row descriptions, so memory
stays O(tile x keys) however long the sequence. Three kernels with one contract (the tile's output and log-sum-exp
forward; gradients from the final output and log-sum-exp backward): on CPU torch's fused flash-attention kernel in
fp32; on CUDA torch's fused memory-efficient kernel (`_scaled_dot_product_efficient_attention` with
`compute_log_sumexp`, and its backward op), which reads q, k, v in the compute dtype (bf16), takes the mask as an
additive bias broadcast over the heads and accumulates in fp32, in tiles bounded by the bias's size (a whole block
of a few thousand rows in one call); elsewhere explicit fp32 matmuls. Blocks merge in fp32 (`merge`) whatever the
kernel. Grouped-query attention expands the block's keys/values to every query head once per block (not per
tile): the fused kernels take equal head counts.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

# A query tile holds at most this many (query, key) scores (per head for the explicit path): 8M fp32 = 32 MB.
TILE_SCORES = 1 << 23
# On CUDA the kernel never stores scores; a tile's only (rows x keys) buffer is its additive mask: 128M entries of
# bf16 = 256 MB, so a block of up to that many (query, key) pairs runs in one call.
TILE_BIAS = 1 << 27

Mask = torch.Tensor | Callable[[int, int], torch.Tensor]  # (Tq, Tk) bool, or rows [a, b) of it on demand


class RingPlan(Protocol):
    """What the ring needs of the layout it runs on (`actor/context_parallel.py`'s `ZigzagPlan` is the one): the
    layout imports the ring, the ring knows the layout only through this."""

    cp: int  # ranks in the ring

    @property
    def local_len(self) -> int:
        """Rows each rank holds."""

    def block(self, q_rank: int, k_rank: int, device: torch.device) -> Any:
        """The visible part of (query rank, key rank): `rows`, `cols` (None: all) and `mask(a, b)`; None when
        nothing is visible."""

    def visible(self, q_rank: int, k_rank: int) -> torch.Tensor:
        """The whole (local_len, local_len) bool mask of the pair."""


def _kind(device: torch.device) -> str:
    """The block kernel on `device`: "cpu" (torch's fused flash kernel), "cuda" (torch's fused memory-efficient
    kernel), or "explicit" (fp32 matmuls, any other device)."""
    return device.type if device.type in ("cpu", "cuda") else "explicit"


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


def _tiles(tq: int, tk: int, heads: int, kind: str):
    if kind == "cuda":  # the bias tile is the only (rows x keys) buffer, shared by the heads
        step = max(1, TILE_BIAS // _align(tk))
    else:
        step = max(1, TILE_SCORES // max(1, tk * (heads if kind == "explicit" else 1)))
    for a in range(0, tq, step):
        yield a, min(tq, a + step)


def _rows(mask: Mask, a: int, b: int) -> torch.Tensor:
    return mask[a:b] if isinstance(mask, torch.Tensor) else mask(a, b)


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    """(T, H, D) -> fp32 (1, H, T, D) contiguous, the CPU kernel's layout."""
    return x.float().transpose(0, 1).contiguous()[None]


def _native(x: torch.Tensor) -> torch.Tensor:
    """(T, H, D) -> (1, H, T, D) in its own dtype, a view of (T, H, D) contiguous memory: the CUDA kernel's layout
    (it reads (1, T, H, D) with the last dimension contiguous)."""
    return x.contiguous().transpose(0, 1)[None]


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys/values (Tk, Hkv, D) -> (Tk, H, D): query head h uses KV head h // groups (transformers' repeat_kv)."""
    return x.repeat_interleave(groups, 1) if groups > 1 else x


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys/values (Tk, Hkv, D) -> (1, H, Tk, D) fp32."""
    return _bhtd(_repeat(x, groups))


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    return h // hkv


def _bias(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cuda_bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(t, Tk) bool -> the additive bias the CUDA kernel takes: (1, H, t, Tk) in q's dtype, broadcast over the heads,
    rows padded to a multiple of 16 keys in memory (the kernel's alignment)."""
    t, tk = mask.shape
    bias = torch.zeros((t, _align(tk)), dtype=q.dtype, device=q.device)[:, :tk].masked_fill_(~mask, float("-inf"))
    return bias[None, None].expand(1, q.shape[1], t, tk)


def _efficient_ops():
    """torch's memory-efficient attention ops (forward with the log-sum-exp, backward)."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward


def _cuda_forward(q, k, v, mask, scale: float):
    """One tile through torch's fused memory-efficient CUDA kernel with the log-sum-exp: q (1, H, t, D), k/v
    (1, H, Tk, D) in the compute dtype -> out (1, H, t, D) in it, lse (1, H, t) fp32."""
    out, lse, _, _ = _efficient_ops()[0](
        q, k, v, _cuda_bias(mask, q), True, 0.0, False, scale=scale)
    return out, lse[..., : q.shape[2]]  # the kernel pads the LSE's rows to a multiple of 32


def _cuda_backward(q, k, v, mask, scale: float, dout, lse, out):
    """The CUDA kernel's backward given the final `out` / `lse` of the tile's rows: dq, dk, dv in the compute
    dtype. Dropout is off, so the random-state arguments are never read."""
    h, t = q.shape[1], q.shape[2]
    lse_p = lse.new_zeros((1, h, _align(t, 32)))
    lse_p[..., :t] = lse
    rng = torch.empty((), dtype=torch.long)
    dq, dk, dv, _ = _efficient_ops()[1](
        dout.to(q.dtype), q, k, v, _cuda_bias(mask, q), out.to(q.dtype), lse_p, rng, rng, 0.0,
        [True, True, True, False], False, scale=scale)
    return dq, dk, dv


def _kernel_forward(q, k, v, mask, scale: float, kind: str):
    """One tile: q (1, H, t, D), k/v (1, H, Tk, D), mask (t, Tk) -> out (1, H, t, D), lse (1, H, t)."""
    if kind == "cuda":
        return _cuda_forward(q, k, v, mask, scale)
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=_bias(mask),
                                                                           scale=scale)
    s = (q @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s.sub_(lse[..., None])) @ v, lse


def _kernel_backward(q, k, v, mask, scale: float, dout, lse, out, kind: str):
    """One tile's gradients given the final (merged) `out` (1, H, t, D) and `lse` (1, H, t): dq, dk, dv."""
    if kind == "cuda":
        return _cuda_backward(q, k, v, mask, scale, dout, lse, out)
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=_bias(mask), scale=scale)
    s = (q @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    p = torch.exp(s.sub_(lse[..., None]))  # the final attention probabilities of this block
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


def block_attention(q, k, v, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (Tq, H, D) over keys/values k, v (Tk, Hkv, D) where `mask` (Tq, Tk) is True; every
    row must see at least one key. Returns the output (Tq, H, D) and the log-sum-exp of the scaled scores (Tq, H),
    both fp32. On CUDA the kernel reads q, k, v in their own dtype (bf16 in training) and accumulates in fp32."""
    g, kind = _groups(q, k), _kind(q.device)
    layout = _native if kind == "cuda" else _bhtd
    kk, vv = layout(_repeat(k, g)), layout(_repeat(v, g))  # expanded once per block, shared by the tiles
    outs, lses = [], []
    for a, b in _tiles(q.shape[0], k.shape[0], q.shape[1], kind):
        o, lse = _kernel_forward(layout(q[a:b]), kk, vv, _rows(mask, a, b), scale, kind)
        outs.append(o[0].transpose(0, 1).float())
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def block_attention_backward(q, k, v, mask: Mask, scale: float, dout, lse, out):
    """Gradients of one block given the final (merged) output `out` (Tq, H, D) and log-sum-exp `lse` (Tq, H):
    dq (Tq, H, D), dk, dv (Tk, Hkv, D), all fp32."""
    g, kind = _groups(q, k), _kind(q.device)
    layout = _native if kind == "cuda" else _bhtd
    kk, vv = layout(_repeat(k, g)), layout(_repeat(v, g))
    dk = torch.zeros(kk.shape, dtype=torch.float32, device=kk.device)
    dv = torch.zeros_like(dk)
    dqs = []
    for a, b in _tiles(q.shape[0], k.shape[0], q.shape[1], kind):
        lse_t = lse[a:b].float().transpose(0, 1).contiguous()[None]
        dq_t, dk_t, dv_t = _kernel_backward(layout(q[a:b]), kk, vv, _rows(mask, a, b), scale, layout(dout[a:b]),
                                            lse_t, layout(out[a:b]), kind)
        dqs.append(dq_t[0].transpose(0, 1).float())
        dk += dk_t
        dv += dv_t
    tk, hkv, d = k.shape

    def fold(x):  # (1, H, Tk, D) -> (Tk, Hkv, D), summing each KV head's query group
        return x[0].transpose(0, 1).reshape(tk, hkv, g, d).sum(2)

    return torch.cat(dqs), fold(dk), fold(dv)


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor):
    """Attention over two disjoint key sets from each one's output (T, H, D) and log-sum-exp (T, H), fp32: the
    softmax-weighted combination, and the log-sum-exp of the union. A row that has seen nothing yet (lse -inf)
    takes the other's values."""
    new = torch.logaddexp(lse, l_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    return out * torch.exp(lse - safe)[..., None] + o_b * torch.exp(l_b - safe)[..., None], new


# --- the ring ----------------------------------------------------------------------------------------------------
def _exchange(send: torch.Tensor, recv: torch.Tensor, group, rank: int, size: int, tag: int):
    """Post send to rank+1 and receive from rank-1 (group ranks); returns the works to wait on."""
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops)


def _take(x, idx):
    return x if idx is None else x.index_select(0, idx)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, scale: float):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        tl, h, d = q.shape
        out = q.new_zeros((tl, h, d), dtype=torch.float32)
        lse = q.new_full((tl, h), float("-inf"), dtype=torch.float32)
        kv = torch.stack([k, v]).contiguous()
        for step in range(size):
            works = []
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _exchange(kv, nxt, group, rank, size, tag=0)
            blk = plan.block(rank, (rank - step) % size, q.device)
            if blk is not None:
                o_b, l_b = block_attention(_take(q, blk.rows), _take(kv[0], blk.cols), _take(kv[1], blk.cols),
                                           blk.mask, scale)
                merged, new = merge(_take(out, blk.rows), _take(lse, blk.rows), o_b, l_b)
                if blk.rows is None:
                    out, lse = merged, new
                else:
                    out.index_copy_(0, blk.rows, merged)
                    lse.index_copy_(0, blk.rows, new)
            for w in works:
                w.wait()
            if works:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, group, scale = ctx.plan, ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.float()
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # travels with kv
        for step in range(size):
            works = []
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _exchange(kv, nxt, group, rank, size, tag=1)
            blk = plan.block(rank, (rank - step) % size, q.device)
            if blk is not None:
                dq_b, dk_b, dv_b = block_attention_backward(
                    _take(q, blk.rows), _take(kv[0], blk.cols), _take(kv[1], blk.cols), blk.mask, scale,
                    _take(dout, blk.rows), _take(lse, blk.rows), _take(out, blk.rows))
                if blk.rows is None:
                    dq += dq_b
                else:
                    dq.index_add_(0, blk.rows, dq_b)
                if blk.cols is None:
                    dkv[0] += dk_b
                    dkv[1] += dv_b
                else:
                    dkv[0].index_add_(0, blk.cols, dk_b)
                    dkv[1].index_add_(0, blk.cols, dv_b)
            if size > 1:  # the accumulated dK/dV go one hop on; after the last step, that hop reaches the owner
                dnxt = torch.empty_like(dkv)
                works += _exchange(dkv, dnxt, group, rank, size, tag=2)
            for w in works:
                w.wait()
            if step < size - 1:
                kv = nxt
            if size > 1:
                dkv = dnxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group=None,
                   scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's local rows over the whole packed row, split over the cp `group` by `plan`.

    q (Tl, H, D) post-RoPE, k / v (Tl, Hkv, D), H a multiple of Hkv (query head h uses KV head h // (H / Hkv), as in
    transformers' repeat_kv) -> (Tl, H, D) in q's dtype. A collective: every rank of the group calls it, in the
    same order, with the same plan. Differentiable in q, k, v.
    """
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size != plan.cp:
        raise ValueError(f"the plan splits over {plan.cp} ranks, the group has {size}")
    if q.shape[0] != plan.local_len or k.shape[0] != plan.local_len or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected {plan.local_len} "
                         "local rows and keys shaped like values")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if size == 1 and not dist.is_initialized():
        return _local_attention(q, k, v, plan, scale)
    if group is None:
        group = dist.group.WORLD
    return _RingAttention.apply(q, k, v, plan, group, scale)


def _local_attention(q, k, v, plan: RingPlan, scale: float) -> torch.Tensor:
    """cp = 1 without a process group: the same rule on one block, through plain ops (autograd)."""
    g = _groups(q, k)
    qq, kk, vv = _bhtd(q), _expand(k, g), _expand(v, g)
    s = ((qq @ kk.transpose(-1, -2)) * scale).masked_fill(~plan.visible(0, 0).to(q.device), float("-inf"))
    return (torch.softmax(s, -1) @ vv)[0].transpose(0, 1).to(q.dtype)
