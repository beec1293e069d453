"""Ring attention over a real gloo cp group against single-process attention. Used by test_context_parallel.py.

    torchrun --nproc_per_node=C tests/distributed/context_parallel_worker.py OUT.json

Every rank builds the same random packed q/k/v (fp32) and upstream gradient, computes the single-process reference
(SDPA per sequence, or `packed_attention` for shared-prompt spans), then its zigzag shard through `ring_attention`;
the output and the q/k/v gradients are all-gathered and compared. Rank 0 writes the max absolute errors.
"""
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparserl.actor.context_parallel import unshard, zigzag_plan
from sparserl.actor.ring_attention import ring_attention
from sparserl.model.attention import ForwardContext, Span, forward_context, packed_attention

D = 8


def reference(q, k, v, spans):
    """Single-process attention of the packed row: SDPA per sequence, or the actor's own packed attention when a
    span has a shared-prompt prefix."""
    if any(sp.prefix is not None for sp in spans):
        with forward_context(ForwardContext(spans=spans)):
            out, _ = packed_attention(SimpleNamespace(layer_idx=0), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], None)
        return out[0]
    outs = []
    for sp in spans:
        qs, ks, vs = (x[sp.start:sp.end].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def spans_of(lengths, prefixes=None):
    spans, at = [], 0
    for i, n in enumerate(lengths):
        spans.append(Span(at, at + n, prefix=None if prefixes is None else prefixes[i]))
        at += n
    return spans


def run_case(name, spans, heads, kv_heads, rank, cp, seed):
    g = torch.Generator().manual_seed(seed)
    T = spans[-1].end
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(T, heads, D, generator=g)
    pos = torch.cat([torch.arange(sp.end - sp.start) for sp in spans])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, spans)
    ref.backward(dout)

    plan = zigzag_plan(spans, cp)
    local = [plan.shard(x, rank).requires_grad_() for x in (q, k, v)]
    out = ring_attention(*local, plan)
    out.backward(plan.shard(dout, rank))
    got = {"out": unshard(out.detach(), plan), **{n: unshard(x.grad, plan) for n, x in zip("qkv", local)}}
    want = {"out": ref.detach(), **{n: x.grad for n, x in zip("qkv", leaves)}}
    errors = {key: float((got[key] - want[key]).abs().max()) for key in want}
    # the layout round-trips, and the RoPE positions of the local rows are the packed row's
    real = plan.rows[rank].valid
    assert torch.equal(unshard(plan.shard(pos, rank), plan), pos), name
    assert torch.equal(plan.positions(rank, pos)[real], plan.shard(pos, rank)[real]), name
    assert out.shape == (plan.local_len, heads, D)
    return errors


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    try:
        # uneven lengths, some shorter than 2C (1, 3), some divisible by 2C (24), one span longer than the rest
        cases = {
            "gqa": (spans_of([13, 3, 29, 1, 8, 24]), 6, 2),
            "mha": (spans_of([7, 24, 2, 11]), 4, 4),
            # shared prompts: a prompt (span 1) with three responses, one of a single token, around two plain spans
            "shared_prompt": (spans_of([9, 10, 5, 1, 7, 4], [None, None, 1, 1, 1, None]), 6, 3),
        }
        results = {name: run_case(name, spans, h, hkv, rank, cp, seed)
                   for seed, (name, (spans, h, hkv)) in enumerate(cases.items())}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
