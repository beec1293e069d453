"""The attention function the native engine and the actor register with transformers.

The Hugging Face model runs its own modules (projections, RoPE, MLPs, norms) on one packed `(1, T)` batch;
only the attention core is ours. It reads what it needs from one `ForwardContext`, set for the duration
of a forward by `forward_context(...)` and reset afterwards (the only module-level state here):

- with a KV cache (engine): the new keys/values are written into the pool at `write_slots`, then each
  sequence's queries attend over its slots (both through sparserl/kv/kv_dtype.py's accessor, so an int8 / fp8
  pool is quantized on write and attended dequantized): decode sequences batched in one padded SDPA call, prefill
  sequences one call each (causal over their new tokens, full over what was cached before).
- without a cache (actor training): each packed sequence attends causally over itself; a span with a
  `prefix` (a shared prompt, actor/logprobs.py) attends over that span's rows first, then causally over itself.
  On CUDA the whole micro-batch is one call per layer (varlen flash or flex attention, model/packed_kernels.py);
  elsewhere one SDPA call per span.
- with context parallelism (actor training, `ctx.cp`): the rows are this rank's share of the packed row and the
  same rule runs as ring attention over the cp group (actor/context_parallel.py).

Left out on purpose: paged kernels for the engine (SDPA covers CPU and CUDA with one code path), sliding-window
and ALiBi models.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F

from sparserl.kv.kv_dtype import read_entries, write_entries
from sparserl.model.packed_kernels import attend, build_layout, choose_packed_backend

ATTN_NAME = "sparserl"


class DecodeAttention(Protocol):
    """Decode attention over an engine's own copy of the decoding sequences' K/V (the native engine's
    `DecodeCache`): the rows' queries `q` of `layer` -> their attention outputs, the pool passed for the new entries."""

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scaling: float | None) -> torch.Tensor: ...


@dataclass
class Span:
    """One sequence's run of new tokens in the packed batch: query rows [start, end)."""

    start: int
    end: int
    slots: torch.Tensor | None = None  # (L,) cache entries to attend over, the new tokens last; None = no cache
    num_cached: int = 0  # entries before the new tokens
    prefix: int | None = None  # no cache: index of an earlier span whose rows come before these (a shared prompt)


@dataclass
class ForwardContext:
    # Sequences computed one by one; their rows tile [n_decode, T) in order.
    spans: list[Span] = field(default_factory=list)
    # Batched single-token decode: query rows [0, n_decode) attend over `decode_slots` (padding masked by `decode_bias`).
    n_decode: int = 0
    decode_slots: torch.Tensor | None = None  # (Bd, Lmax) long
    decode_bias: torch.Tensor | None = None  # (Bd, 1, 1, Lmax) float32: 0 where valid, -inf on padding
    decode_cache: DecodeAttention | None = None  # instead of the two above: contiguous copies (engines/native/decode_cache.py)
    write_slots: torch.Tensor | None = None  # (T,) long
    # Per layer (S, H_kv, D): a tensor, or a `KVStore` when the pool is not in the compute dtype (rollout.kv_dtype,
    # kv/kv_dtype.py); either is written and read only through `write_entries` / `read_entries`.
    k_cache: list | None = None
    v_cache: list | None = None
    # Called as on_queries(layer_idx, query (T, H, D)) so compression can keep recent queries.
    on_queries: Callable[[int, torch.Tensor], None] | None = None
    # The actor's forwards: what the LM head computes instead of full logits (actor/logprobs.py `LogprobHead`).
    head: Callable | None = None
    # Context parallelism (actor/context_parallel.py `CPAttention`): the rows are this rank's zigzag share of the
    # packed row; attention is `cp.attend(q, k, v, scaling)` (ring attention over the cp group), `spans` unused.
    cp: object | None = None
    # Without a cache: the micro-batch's single-call layout (model/packed_kernels.py), built by the first layer.
    packed: object | None = None


_CTX: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CTX
    assert _CTX is None, "forward contexts do not nest"
    _CTX = ctx
    try:
        yield ctx
    finally:
        _CTX = None


def current_context() -> ForwardContext | None:
    return _CTX


def _sdpa(q, k, v, mask=None, causal=False, scale=None):  # (B, H, Tq, D), (B, Hkv, Tk, D)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _decode_attention(q, k_cache, v_cache, ctx: ForwardContext, scaling: float | None) -> torch.Tensor:
    """One query per sequence over its cached entries: (Bd, H, D) -> (Bd, H, D).

    The gathered keys/values stay strided views (Bd, H_kv, L, D) and go to SDPA with the query heads of one KV
    head as its query rows, (Bd, H_kv, G, D): no copy to make them contiguous, no GQA expansion. At SmolLM2's
    shapes this was faster than grouped matmuls over the same views at batch 64 and not slower at batch 1 or 16
    (benchmarks/decode_attention.py times both). The gather uses index_select (advanced indexing with a 2-D index is much
    slower on CPU).
    """
    bd, H, D = q.shape
    idx = ctx.decode_slots  # (Bd, Lmax)
    L = idx.shape[1]
    k = read_entries(k_cache, idx.reshape(-1)).view(bd, L, -1, D).transpose(1, 2)  # (Bd, H_kv, L, D)
    v = read_entries(v_cache, idx.reshape(-1)).view(bd, L, -1, D).transpose(1, 2)
    hkv = k.shape[1]
    qg = q.view(bd, hkv, H // hkv, D).to(k.dtype)  # (Bd, H_kv, G, D): query heads of one KV head together
    bias = ctx.decode_bias if ctx.decode_bias.dtype == k.dtype else ctx.decode_bias.to(k.dtype)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scaling)  # bias (Bd, 1, 1, L): 0 / -inf
    return out.reshape(bd, H, D).to(q.dtype)


def _span_attention(span: Span, q, k, v, k_cache, v_cache, scaling, prefix=None) -> torch.Tensor:
    """Causal attention of one sequence's new rows (n, H, D) over its cached entries (or the `prefix` span's
    (keys, values) rows) and themselves."""
    qs = q.transpose(0, 1)[None]  # (1, H, n, D)
    num_cached = span.num_cached
    if span.slots is None:
        if prefix is not None:
            k, v, num_cached = torch.cat([prefix[0], k]), torch.cat([prefix[1], v]), prefix[0].shape[0]
        ks, vs = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    else:
        ks = read_entries(k_cache, span.slots).transpose(0, 1)[None]  # (1, H_kv, L, D)
        vs = read_entries(v_cache, span.slots).transpose(0, 1)[None]
    if num_cached == 0:
        o = _sdpa(qs, ks, vs, causal=True, scale=scaling)
    else:
        # Everything cached before is visible; the new tokens see each other causally.
        n, L = q.shape[0], ks.shape[2]
        rows = torch.arange(n, device=q.device)[:, None] + num_cached
        mask = torch.arange(L, device=q.device)[None, :] <= rows  # (n, L)
        o = _sdpa(qs, ks, vs, mask=mask, scale=scaling)
    return o[0].transpose(0, 1)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D) post-RoPE
    key: torch.Tensor,  # (1, H_kv, T, D) post-RoPE
    value: torch.Tensor,  # (1, H_kv, T, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = _CTX
    if ctx is None:
        # Outside the engine/actor the model behaves like a stock SDPA model (e.g. `generate` in a notebook).
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # (T, H, D)
    k_new = key[0].transpose(0, 1)  # (T, H_kv, D)
    v_new = value[0].transpose(0, 1)
    if ctx.cp is not None:  # actor training with context parallelism: no cache, no decode rows
        return ctx.cp.attend(q, k_new, v_new, scaling)[None], None
    if ctx.on_queries is not None:
        ctx.on_queries(layer, q)
    if ctx.k_cache is None and not ctx.n_decode and ctx.spans:
        if ctx.packed is None:
            ctx.packed = build_layout(ctx.spans, q.device, choose_packed_backend(q.device, q.dtype))
        if ctx.packed.backend != "spans":
            return attend(ctx.packed, q, k_new, v_new, scaling)[None], None
    k_cache = v_cache = None
    decoded = None
    if ctx.k_cache is not None:
        k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
        # Written first, then read back with the rest: a quantized pool's new tokens are attended as stored.
        write_entries(k_cache, ctx.write_slots, k_new)
        write_entries(v_cache, ctx.write_slots, v_new)
        if ctx.n_decode and ctx.decode_cache is not None:
            decoded = ctx.decode_cache.attend(layer, q[: ctx.n_decode], k_cache, v_cache, scaling)
        elif ctx.n_decode:
            decoded = _decode_attention(q[: ctx.n_decode], k_cache, v_cache, ctx, scaling)
    # Rows are [decode rows][span 0][span 1]...: split and concatenate rather than slice and assign, so that
    # backward costs one gather and one scatter per layer instead of a full-size zero tensor per sequence.
    sizes = [ctx.n_decode] + [sp.end - sp.start for sp in ctx.spans]
    q_parts, k_parts, v_parts = (torch.split(x, sizes) for x in (q, k_new, v_new))
    parts = [decoded] if decoded is not None else []
    for span, qs, ks, vs in zip(ctx.spans, q_parts[1:], k_parts[1:], v_parts[1:]):
        prefix = None if span.prefix is None else (k_parts[1 + span.prefix], v_parts[1 + span.prefix])
        parts.append(_span_attention(span, qs, ks, vs, k_cache, v_cache, scaling, prefix))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[None], None  # (1, T, H, D)


def _mask(*args, **kwargs):
    if _CTX is not None:
        return None  # masks are per span, built inside `packed_attention`
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> str:
    """Register the attention (and a no-op mask) with transformers; returns the implementation name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(ATTN_NAME, packed_attention)
        AttentionMaskInterface.register(ATTN_NAME, _mask)
        _registered = True
    return ATTN_NAME


def use_packed_attention(model: torch.nn.Module) -> None:
    name = register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name
