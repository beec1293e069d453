"""Context parallelism's building block (sparserl/actor/context_parallel.py): the zigzag layout (single process) and
exact ring attention over real 2-, 3- and 4-process gloo groups, forward and backward, against single-process
attention in fp32 (GQA and MHA, uneven packed lengths including ones shorter than 2C, shared-prompt prefixes)."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sparserl.actor.context_parallel import zigzag_plan
import sparserl.actor.ring_attention as ring_attention_module
from sparserl.actor.ring_attention import block_attention, block_attention_backward, ring_attention
from sparserl.model.attention import Span
from tests.launch import command

WORKER = Path(__file__).with_name("context_parallel_worker.py")
ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [13, 3, 29, 1, 8, 24, 0, 5]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_matches_single_process(tmp_path, cp):
    out = tmp_path / "errors.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = command(cp, WORKER, out)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    errors = json.loads(out.read_text())
    assert set(errors) == {"gqa", "mha", "shared_prompt"}
    for case, errs in errors.items():
        assert set(errs) == {"out", "q", "k", "v"}
        for key, err in errs.items():
            assert err < 1e-5, (cp, case, key, err)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_round_trip(cp):
    plan = zigzag_plan(LENGTHS, cp)
    T = sum(LENGTHS)
    x = torch.randn(T, 3, 2)
    shards = [plan.shard(x, r, fill=float("nan")) for r in range(cp)]
    assert all(s.shape == (plan.local_len, 3, 2) for s in shards)
    assert plan.local_len == sum(2 * cp * plan.chunk(s) for s in range(len(LENGTHS))) // cp
    assert torch.equal(plan.unshard_gathered(torch.stack(shards)), x)
    # padding rows hold `fill` and nothing else does; each real row lands on exactly one rank
    for r, s in enumerate(shards):
        assert torch.equal(s.isnan().all(-1).all(-1), ~plan.rows[r].valid)
    index = torch.cat([plan.rows[r].index for r in range(cp)])
    assert sorted(index[index >= 0].tolist()) == list(range(T))
    # rank r holds chunks r and 2C-1-r of every span, in order
    r = cp - 1
    c = plan.chunk(2)  # the 29-long span
    rows = plan.rows[r]
    idx = rows.idx[rows.span == 2].tolist()
    assert idx == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def test_zigzag_positions():
    spans = [Span(0, 6), Span(6, 11), Span(11, 14, prefix=1), Span(14, 15, prefix=1)]
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 5])  # responses continue after their prompt
    plan = zigzag_plan(spans, 2)
    for r in range(2):
        got, rows = plan.positions(r, pos), plan.rows[r]
        assert torch.equal(got[rows.valid], pos[rows.index[rows.valid]])
        assert torch.equal(plan.positions(r)[rows.valid], rows.idx[rows.valid])
        pads = ~rows.valid  # padding continues its span's positions
        last = torch.tensor([pos[sp.end - 1] for sp in spans])[rows.span[pads]]
        n = torch.tensor([sp.end - sp.start for sp in spans])[rows.span[pads]]
        assert torch.equal(got[pads], last + rows.idx[pads] - n + 1)


def test_padding_and_prefix_mask():
    spans = [Span(0, 10), Span(10, 13, prefix=0)]  # prompt of 10 (padded to 12 for cp=2), response of 3 (to 4)
    plan = zigzag_plan(spans, 2)
    for qr in range(2):
        for kr in range(2):
            vis = plan.visible(qr, kr)
            q, k = plan.rows[qr], plan.rows[kr]
            real_q = q.valid[:, None].expand_as(vis)
            assert not (vis & real_q & ~k.valid[None]).any()  # no real query sees padding
            resp = (q.span == 1) & q.valid
            # a real response row sees every real prompt row
            assert vis[resp][:, (k.span == 0) & k.valid].all()
    for r in range(2):  # every row sees at least itself
        assert plan.visible(r, r).diagonal().all()


def _work_bound(plan):
    """One chunk's worth of work per span: a chunk of queries over the whole span."""
    return sum(plan.chunk(s) * n for s, n in enumerate(plan.lengths))


def _padding_work(plan):
    """The causal work the padding rows would have had: full chunks give every rank the same work, so the padding
    (at most 2C-1 rows per span, in the last chunks) is the only source of imbalance."""
    return sum(sum(range(n + 1, 2 * plan.cp * plan.chunk(s) + 1)) for s, n in enumerate(plan.lengths))


def _contiguous_work(lengths, cp):
    work = [0] * cp
    for n in lengths:
        piece = -(-n // cp)
        for i in range(n):
            work[min(i // piece, cp - 1)] += i + 1
    return work


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_balances_causal_work(cp):
    even = zigzag_plan([4 * cp, 6 * cp, 2 * cp], cp)
    assert len(set(even.causal_work())) == 1  # no padding: exactly the same work everywhere
    for lengths in (LENGTHS, [50 * cp + 3, 30 * cp + 1, 7]):
        plan = zigzag_plan(lengths, cp)
        work = plan.causal_work()
        assert sum(work) == sum(n * (n + 1) // 2 for n in lengths)
        assert max(work) - min(work) <= min(_work_bound(plan), _padding_work(plan)), work
    contiguous = _contiguous_work(lengths, cp)  # splitting each span into C contiguous pieces is far off
    assert max(contiguous) - min(contiguous) > 4 * _padding_work(plan)


def test_local_ring_attention_without_group():
    """cp = 1 outside a process group: the block mask alone gives per-sequence causal attention."""
    assert not torch.distributed.is_initialized()
    plan = zigzag_plan(LENGTHS, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), h, 8, generator=g) for h in (6, 2, 2))
    out = plan.unshard_gathered(ring_attention(*(plan.shard(x, 0) for x in (q, k, v)), plan)[None])
    ref, at = [], 0
    for n in LENGTHS:
        s = slice(at, at + n)
        ref.append(F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                                  is_causal=True, enable_gqa=True).transpose(0, 1))
        at += n
    assert (out - torch.cat(ref)).abs().max() < 1e-5


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("tile_scores", [1 << 23, 12])
def test_block_attention_backward_matches_autograd(monkeypatch, flash, tile_scores):
    """The block kernel's contract: output + LSE forward, and the LSE-based backward, against plain autograd; with
    the fused CPU kernel and with the explicit one (other devices), in one tile and in query tiles of 1-2 rows."""
    monkeypatch.setattr(ring_attention_module, "_kind", lambda device: "cpu" if flash else "explicit")
    monkeypatch.setattr(ring_attention_module, "TILE_SCORES", tile_scores)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(5, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(5, 2, 8, generator=g, requires_grad=True)
    mask = torch.rand(7, 5, generator=g) < 0.6
    mask[:, 0] = True
    out, lse = block_attention(q, k, v, mask, 0.3)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, 1)) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(3, 1))
    assert (out - ref).abs().max() < 1e-6
    assert (lse - s.logsumexp(-1).T).abs().max() < 1e-6
    dout = torch.randn(7, 6, 8, generator=g)
    ref.backward(dout)
    dq, dk, dv = block_attention_backward(q.detach(), k.detach(), v.detach(), mask, 0.3, dout, lse, out)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (got - want).abs().max() < 1e-5


def test_plan_rejects_bad_layouts():
    with pytest.raises(ValueError, match="tile"):
        zigzag_plan([Span(0, 3), Span(4, 6)], 2)
    with pytest.raises(ValueError, match="earlier span"):
        zigzag_plan([Span(0, 3, prefix=0)], 2)
    with pytest.raises(ValueError, match="cached"):
        zigzag_plan([Span(0, 3, slots=torch.arange(3))], 2)
    with pytest.raises(ValueError, match="ranks"):
        ring_attention(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), zigzag_plan([4], 2))


@pytest.mark.parametrize("cp", [2, 3])
def test_block_rows_cols_and_tile_masks_match_the_rule(cp):
    """`ZigzagPlan.block` finds the visible rows/columns without building the (rows x cols) mask; its on-demand
    masks equal the attention rule (`visible`) on those rows and columns, in any row range."""
    spans = [Span(0, 10), Span(10, 13, prefix=0), Span(13, 14, prefix=0), Span(14, 31), Span(31, 33)]
    plan = zigzag_plan(spans, cp)
    for qr in range(cp):
        for kr in range(cp):
            vis = plan.visible(qr, kr)
            blk = plan.block(qr, kr, torch.device("cpu"))
            if not vis.any():
                assert blk is None
                continue
            rows = torch.arange(vis.shape[0]) if blk.rows is None else blk.rows
            cols = torch.arange(vis.shape[1]) if blk.cols is None else blk.cols
            assert torch.equal(rows, vis.any(1).nonzero().squeeze(1))
            assert torch.equal(cols, vis.any(0).nonzero().squeeze(1))
            sub = vis[rows][:, cols]
            assert torch.equal(blk.mask(0, len(rows)), sub)
            assert torch.equal(blk.mask(1, 3), sub[1:3])
