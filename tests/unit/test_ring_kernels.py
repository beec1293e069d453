"""Ring attention's block kernels and their merge (sparserl/actor/ring_attention.py), on CPU: which kernel each
device runs, the CUDA kernel's calling contract (layout, bias alignment and dtype, the padded log-sum-exp) through a
stand-in that checks it and computes in fp32, and blocks over disjoint key sets merged by their log-sum-exp against
one attention over all keys, forward and backward. tests/gpu/test_update_cuda.py runs the real CUDA kernel."""
import pytest
import torch

import sparserl.actor.ring_attention as ring
from sparserl.actor.ring_attention import block_attention, block_attention_backward, merge


def test_kernel_by_device():
    assert ring._kind(torch.device("cpu")) == "cpu"
    assert ring._kind(torch.device("cuda", 0)) == "cuda"
    assert ring._kind(torch.device("meta")) == "explicit"


def test_cuda_tiles_are_bounded_by_the_bias():
    tiles = list(ring._tiles(20_000, 9_000, 12, "cuda"))
    assert tiles[0] == (0, ring.TILE_BIAS // ring._align(9_000)) and tiles[-1][1] == 20_000
    assert list(ring._tiles(3_000, 3_000, 12, "cuda")) == [(0, 3_000)]  # a whole block in one call


def _check_inputs(q, k, v, bias):
    for x in (q, k, v):
        assert x.dim() == 4 and x.stride(-1) == 1 and x.dtype == q.dtype
    assert k.shape[1] == q.shape[1], "the fused kernel takes equal head counts"
    assert bias.dtype == q.dtype and bias.shape == (1, q.shape[1], q.shape[2], k.shape[2])
    assert bias.stride(-1) == 1 and bias.stride(2) % 16 == 0 and bias.stride(1) == 0


def _scores(q, k, bias, scale):
    return (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()


def fake_forward(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
    """What the CUDA op returns, computed in fp32: out in q's dtype, the LSE padded to a multiple of 32 rows."""
    _check_inputs(q, k, v, bias)
    assert compute_lse and dropout_p == 0.0 and not is_causal
    s = _scores(q, k, bias, scale)
    lse = s.logsumexp(-1)
    pad = torch.full((*lse.shape[:2], ring._align(lse.shape[2], 32)), float("nan"))
    pad[..., : lse.shape[2]] = lse
    empty = torch.empty((), dtype=torch.long)
    return (s - lse[..., None]).exp() @ v.float(), pad, empty, empty


def fake_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, is_causal, *, scale):
    _check_inputs(q, k, v, bias)
    t = q.shape[2]
    assert out.dtype == dout.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape[2] % 32 == 0
    assert list(grad_mask) == [True, True, True, False] and dropout_p == 0.0
    p = (_scores(q, k, bias, scale) - lse[..., :t, None]).exp()
    do, o = dout.float(), out.float()
    ds = p * (do @ v.float().transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    grads = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ do
    return (*(g.to(q.dtype) for g in grads), None)


def _reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(g, 1)), s.logsumexp(-1).T


def _inputs(seed=0, tq=37, tk=29, h=6, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, heads, d, generator=g) for n, heads in ((tq, h), (tk, hkv), (tk, hkv)))
    mask = torch.rand(tq, tk, generator=g) < 0.5
    mask[:, 3] = True
    return q, k, v, mask


@pytest.mark.parametrize("tile_bias", [1 << 27, 40])
def test_cuda_contract_through_a_stand_in(monkeypatch, tile_bias):
    """The CUDA path's arguments satisfy the kernel's checks and its results come back right, in one tile and in
    tiles of one or two rows."""
    monkeypatch.setattr(ring, "_kind", lambda device: "cuda")
    monkeypatch.setattr(ring, "_efficient_ops", lambda: (fake_forward, fake_backward))
    monkeypatch.setattr(ring, "TILE_BIAS", tile_bias)
    q, k, v, mask = _inputs()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = block_attention(q, k, v, mask, 0.3)
    ref, ref_lse = _reference(q, k, v, mask, 0.3)
    assert out.dtype == lse.dtype == torch.float32
    assert (out - ref).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5
    dout = torch.randn_like(ref)
    ref.backward(dout)
    grads = block_attention_backward(q.detach(), k.detach(), v.detach(), mask, 0.3, dout, lse, out)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert got.dtype == torch.float32 and (got - want).abs().max() < 1e-4


def test_cuda_path_reads_bf16_and_merges_in_fp32(monkeypatch):
    monkeypatch.setattr(ring, "_kind", lambda device: "cuda")
    monkeypatch.setattr(ring, "_efficient_ops", lambda: (fake_forward, fake_backward))
    q, k, v, mask = _inputs(1)
    out, lse = block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
    ref, _ = _reference(*(x.bfloat16().float() for x in (q, k, v)), mask, 0.3)
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 2e-2


@pytest.mark.parametrize("kind", ["cpu", "explicit"])
def test_blocks_over_split_keys_merge_to_one_attention(monkeypatch, kind):
    """Keys split into three blocks: each block's kernel, merged by log-sum-exp in any order, equals attention over
    all keys; each block's backward from the merged output and log-sum-exp sums to the whole gradient."""
    monkeypatch.setattr(ring, "_kind", lambda device: kind)
    q, k, v, mask = _inputs(2, tk=30)
    mask[:, 10:] &= torch.rand(37, 20) < 0.8  # some rows see nothing in a block
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref, ref_lse = _reference(q, k, v, mask, 0.25)
    cuts = [(0, 10), (10, 20), (20, 30)]
    out = torch.zeros(37, 6, 8)
    lse = torch.full((37, 6), float("-inf"))
    for a, b in reversed(cuts):
        rows = mask[:, a:b].any(1).nonzero().squeeze(1)
        o_b, l_b = block_attention(q.detach()[rows], k.detach()[a:b], v.detach()[a:b], mask[rows, a:b], 0.25)
        merged, new = merge(out[rows], lse[rows], o_b, l_b)
        out[rows], lse[rows] = merged, new
    assert (out - ref).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq, dk, dv = torch.zeros(37, 6, 8), torch.zeros(30, 2, 8), torch.zeros(30, 2, 8)
    for a, b in cuts:
        rows = mask[:, a:b].any(1).nonzero().squeeze(1)
        dq_b, dk[a:b], dv[a:b] = block_attention_backward(q.detach()[rows], k.detach()[a:b], v.detach()[a:b],
                                                          mask[rows, a:b], 0.25, dout[rows], lse[rows], out[rows])
        dq.index_add_(0, rows, dq_b)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (got - want).abs().max() < 1e-5


def test_merge_with_an_empty_side():
    o, l_ = torch.randn(4, 2, 3), torch.randn(4, 2)
    empty_o, empty_l = torch.zeros(4, 2, 3), torch.full((4, 2), float("-inf"))
    for got_o, got_l in (merge(empty_o, empty_l, o, l_), merge(o, l_, empty_o, empty_l)):
        assert torch.equal(got_l, l_) and (got_o - o).abs().max() < 1e-6
    both_o, both_l = merge(empty_o, empty_l, empty_o, empty_l)
    assert torch.isinf(both_l).all() and torch.equal(both_o, empty_o)


def simulated_ring(q, k, v, plan, scale):
    """Every rank's share of ring attention in one process, without communication: the same blocks, kernels and
    merge as `_RingAttention`, forward and backward (the output's gradient: ones on real rows, 0 on padding). Returns the unsharded
    output (T, H, D) and gradients dq (T, H, D), dk, dv (T, Hkv, D), all fp32."""
    cp, dev = plan.cp, q.device
    qs, ks, vs = ([plan.shard(x, r) for r in range(cp)] for x in (q, k, v))
    outs, lses = [], []
    for r in range(cp):
        out = torch.zeros(qs[r].shape, dtype=torch.float32, device=dev)
        lse = torch.full(qs[r].shape[:2], float("-inf"), device=dev)
        for j in range(cp):
            blk = plan.block(r, j, dev)
            if blk is not None:
                o_b, l_b = block_attention(ring._take(qs[r], blk.rows), ring._take(ks[j], blk.cols),
                                           ring._take(vs[j], blk.cols), blk.mask, scale)
                merged, new = merge(ring._take(out, blk.rows), ring._take(lse, blk.rows), o_b, l_b)
                out, lse = (merged, new) if blk.rows is None else (out.index_copy(0, blk.rows, merged),
                                                                   lse.index_copy(0, blk.rows, new))
        outs.append(out)
        lses.append(lse)
    dout = [plan.rows[r].valid.to(dev, torch.float32)[:, None, None].expand_as(outs[r]) for r in range(cp)]
    dq = [torch.zeros_like(o) for o in outs]
    dk = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in ks]
    dv = [torch.zeros_like(x) for x in dk]
    for r in range(cp):
        for j in range(cp):
            blk = plan.block(r, j, dev)
            if blk is None:
                continue
            rows, cols = (torch.arange(n, device=dev) if i is None else i for n, i in
                          ((plan.local_len, blk.rows), (plan.local_len, blk.cols)))
            g = block_attention_backward(qs[r][rows], ks[j][cols], vs[j][cols], blk.mask, scale,
                                         dout[r][rows], lses[r][rows], outs[r][rows])
            dq[r].index_add_(0, rows, g[0])
            dk[j].index_add_(0, cols, g[1])
            dv[j].index_add_(0, cols, g[2])
    return tuple(plan.unshard_gathered(torch.stack(x)) for x in (outs, dq, dk, dv))


def packed_reference(q, k, v, spans, scale):
    """Attention under the packed rule, fp32 autograd: (out, dq, dk, dv) for an all-ones output gradient."""
    t = q.shape[0]
    span = torch.empty(t, dtype=torch.long)
    for i, sp in enumerate(spans):
        span[sp.start : sp.end] = i
    prefix = torch.tensor([-1 if sp.prefix is None else sp.prefix for sp in spans])[span]
    pos = torch.arange(t)
    mask = ((span[:, None] == span[None]) & (pos[None] <= pos[:, None])) | (prefix[:, None] == span[None])
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, _ = _reference(q, k, v, mask.to(q.device), scale)
    out.sum().backward()
    return out.detach(), q.grad, k.grad, v.grad




def ring_spans():
    from sparserl.model.attention import Span

    return [Span(0, 40), Span(40, 70, prefix=0), Span(70, 95, prefix=0), Span(95, 150), Span(150, 153)]


@pytest.mark.parametrize("kind", ["cpu", "explicit", "cuda"])
def test_simulated_ring_equals_one_attention(monkeypatch, kind):
    """Three ranks' blocks of a zigzag plan (prefix spans, padding, uneven lengths), merged and differentiated as the
    ring does, against one attention over the packed row; "cuda" through the stand-in, in tiles of a few rows."""
    from sparserl.actor.context_parallel import zigzag_plan

    monkeypatch.setattr(ring, "_kind", lambda device: kind)
    monkeypatch.setattr(ring, "_efficient_ops", lambda: (fake_forward, fake_backward))
    monkeypatch.setattr(ring, "TILE_BIAS", 200)
    monkeypatch.setattr(ring, "TILE_SCORES", 300)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(153, n, 16, generator=g) for n in (6, 2, 2))
    got = simulated_ring(q, k, v, zigzag_plan(ring_spans(), 3), 0.25)
    for a, b in zip(got, packed_reference(q, k, v, ring_spans(), 0.25)):
        assert (a - b).abs().max() < 1e-4
