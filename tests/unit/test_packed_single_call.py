"""The single-call packed attention (model/packed_kernels.py) against the per-span path it replaces on CUDA.

On CPU: the flex path's forward (flex has no backward on CPU) and the varlen layout run through
`varlen_reference` (one SDPA call per varlen segment, causal aligned bottom-right), forward and backward, both
against the per-span path at fp32 rounding; the block mask against flex's own `create_block_mask`; the choice of
backend for every device / dtype / availability. tests/gpu/test_packed_cuda.py runs the CUDA kernels.
"""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from sparserl.actor.logprobs import PackedSeqs, _layout, packed_logprobs
from sparserl.model import packed_kernels as pk
from sparserl.model.attention import ForwardContext, Span, _span_attention, forward_context, use_packed_attention
from tests.conftest import tiny_config

CPU = torch.device("cpu")
# Spans 1 and 2 and 5 and 6 have prefixes (shared prompts); 2 is one row long, 4 and 6 cross flex's 128-row blocks
# and cover whole blocks.
LENGTHS = [10, 5, 1, 21, 300, 3, 260]
PREFIXES = [None, 0, 0, None, None, 4, 4]


def make_spans(lengths=LENGTHS, prefixes=PREFIXES) -> list[Span]:
    spans, at = [], 0
    for n, p in zip(lengths, prefixes):
        spans.append(Span(at, at + n, prefix=p))
        at += n
    return spans


def per_span(spans, q, k, v, scale):
    """The per-span path of `packed_attention` without a cache: the reference."""
    sizes = [sp.end - sp.start for sp in spans]
    qp, kp, vp = (torch.split(x, sizes) for x in (q, k, v))
    return torch.cat([_span_attention(sp, qp[i], kp[i], vp[i], None, None, scale,
                                      None if sp.prefix is None else (kp[sp.prefix], vp[sp.prefix]))
                      for i, sp in enumerate(spans)])


def qkv(T, heads, kv_heads, dim=16, dtype=torch.float32, device=CPU, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, dim, generator=g, dtype=torch.float32).to(device, dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def model(kv_heads: int, family: str = "llama", dtype=torch.float32, device=CPU):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, vocab=120)
    cfg.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).to(device, dtype).train()
    use_packed_attention(m)
    return m


def grouped_seqs(vocab: int = 120) -> PackedSeqs:
    """Prompts shared by several samples (one a single token), responses of one token, a lone sequence."""
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = rand(7), rand(4), rand(1)
    ids = [a + rand(5), b + rand(6), a + rand(1), a + rand(9), rand(3) + rand(4), b + rand(2), c + rand(3), c + rand(1)]
    return PackedSeqs(ids, [7, 4, 7, 7, 3, 4, 1, 1])


def logits_of(m, seqs, share, device=CPU):
    flat, pos, _, _, spans = _layout(seqs, share)
    with forward_context(ForwardContext(spans=spans)):
        return m(input_ids=torch.tensor([flat], device=device), position_ids=torch.tensor([pos], device=device),
                 use_cache=False).logits[0]


def logprobs_and_grads(m, seqs, share, device=CPU, grad=True):
    m.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        logp, ent = packed_logprobs(m, seqs, device, 0.8, with_entropy=True, share_prompts=share)
    if not grad:
        return logp, ent, {}
    mask = torch.zeros_like(logp)
    for i, r in enumerate(seqs.resp_lens):
        mask[i, :r] = 1
    g = torch.Generator().manual_seed(4)
    w = torch.randn(logp.shape, generator=g).to(logp.device)
    ((logp * w + ent * w.flip(1)) * mask).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def close_grads(got, ref, rel):
    for n, g in ref.items():
        assert float((got[n] - g).norm()) <= rel * float(g.norm()) + 1e-12, (n, float((got[n] - g).abs().max()))


def test_varlen_layout():
    spans = make_spans([3, 2, 1, 4], [None, 0, 0, None])
    lay = pk.build_layout(spans, CPU, "varlen_reference")
    assert lay.cu_q.tolist() == [0, 3, 5, 6, 10]
    assert lay.cu_k.tolist() == [0, 3, 8, 12, 16]  # segments 1 and 2 carry the prompt's 3 rows first
    assert lay.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9]
    assert (lay.max_q, lay.max_k) == (4, 5)
    assert lay.cu_q.dtype == lay.cu_k.dtype == torch.int32
    plain = pk.build_layout(make_spans([3, 2], [None, None]), CPU, "varlen")
    assert plain.kv_index is None and plain.cu_k.tolist() == [0, 3, 5]  # no prefix: no gather
    with pytest.raises(ValueError):
        pk.build_layout([Span(0, 3), Span(4, 6)], CPU, "varlen")  # a gap in the rows
    with pytest.raises(ValueError):
        pk.build_layout([Span(0, 3), Span(3, 6, prefix=1)], CPU, "varlen")  # a prefix must come earlier


def test_block_mask_matches_flex_create_block_mask():
    spans = make_spans()
    T = spans[-1].end
    mine = pk.build_layout(spans, CPU, "flex").block_mask
    span_of = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    pre_of = torch.tensor([-1 if p is None else p for p in PREFIXES])[span_of]

    def rule(b, h, q, k):
        return ((span_of[k] == span_of[q]) & (k <= q)) | (span_of[k] == pre_of[q])

    ref = create_block_mask(rule, None, None, T, T, device="cpu")
    assert int(ref.full_kv_num_blocks.sum()) > 0  # whole blocks are classified too
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name
    for nums, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for i, n in enumerate(getattr(ref, nums)[0, 0].tolist()):
            assert sorted(getattr(mine, idx)[0, 0, i, :n].tolist()) == sorted(getattr(ref, idx)[0, 0, i, :n].tolist())
    rows = torch.arange(T)
    dense = rule(0, 0, rows[:, None], rows[None])
    assert torch.equal(mine.mask_mod(0, 0, rows[:, None], rows[None]), dense)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_flex_forward_matches_per_span(kv_heads):
    spans = make_spans()
    q, k, v = (x.detach() for x in qkv(spans[-1].end, 4, kv_heads))
    ref = per_span(spans, q, k, v, 0.3)
    out = pk.attend(pk.build_layout(spans, CPU, "flex"), q, k, v, 0.3)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
def test_varlen_layout_forward_and_backward_match_per_span(kv_heads, shared):
    spans = make_spans(prefixes=PREFIXES if shared else [None] * len(LENGTHS))
    q, k, v = qkv(spans[-1].end, 4, kv_heads)
    w = torch.randn(spans[-1].end, 4, 16)
    ref = per_span(spans, q, k, v, 0.3)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    out = pk.attend(pk.build_layout(spans, CPU, "varlen_reference"), q, k, v, 0.3)
    g = torch.autograd.grad((out * w).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max() < 1e-5


# GQA and MHA, shared prompts on and off, both families, in three runs (each a few model passes per path).
@pytest.mark.parametrize("kv_heads,family,share", [(2, "qwen2", True), (4, "llama", True), (2, "llama", False)],
                         ids=["shared-gqa-qwen2", "shared-mha", "unshared-gqa"])
def test_model_through_single_call_layouts(kv_heads, family, share):
    """Logits, log-probs and entropies through flex (forward only on CPU) and, with gradients, through the varlen
    layout, each against the per-span path of the same model."""
    m, seqs = model(kv_heads, family), grouped_seqs()
    with pk.force_backend("spans"):
        logits0 = logits_of(m, seqs, share).detach()
        lp0, ent0, g0 = logprobs_and_grads(m, seqs, share)
    with pk.force_backend("flex"), torch.no_grad():
        assert (logits_of(m, seqs, share) - logits0).abs().max() < 1e-5
        lp, ent, _ = logprobs_and_grads(m, seqs, share, grad=False)
        assert (lp - lp0).abs().max() < 1e-5 and (ent - ent0).abs().max() < 1e-5
    with pk.force_backend("varlen_reference"):
        assert (logits_of(m, seqs, share) - logits0).abs().max() < 1e-5
        lp, ent, g = logprobs_and_grads(m, seqs, share)
    assert (lp - lp0).abs().max() < 1e-5 and (ent - ent0).abs().max() < 1e-5
    close_grads(g, g0, 1e-5)
    assert sum(float(x.abs().sum()) for x in g0.values()) > 0


def test_layout_is_built_once_per_micro_batch(monkeypatch):
    calls = []
    real = pk.build_layout
    import sparserl.model.attention as attention

    monkeypatch.setattr(attention, "build_layout", lambda *a: calls.append(a[2]) or real(*a))
    m = model(2)
    with pk.force_backend("varlen_reference"), torch.no_grad():
        logits_of(m, grouped_seqs(), True)
    assert calls == ["varlen_reference"]  # two layers, one layout
    calls.clear()
    with torch.no_grad():
        logits_of(m, grouped_seqs(), True)
    assert calls == ["spans"]  # CPU default: the per-span path


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("flash,varlen,flex", [(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)])
def test_cuda_choice_is_one_call_and_never_math(dtype, flash, varlen, flex):
    def choose():
        return pk.choose_packed_backend(CUDA, dtype, flash_attn=flash, torch_varlen=varlen, flex=flex)

    if dtype == FP32:
        expected = "flex" if flex else None  # the varlen kernels take fp16 / bf16 only
    else:
        expected = "flash_attn" if flash else "varlen" if varlen else "flex" if flex else None
    if expected is None:
        with pytest.raises(RuntimeError):
            choose()
    else:
        assert choose() == expected and expected in pk.SINGLE_CALL


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_cpu_keeps_the_per_span_path(dtype):
    assert pk.choose_packed_backend(CPU, dtype, flash_attn=True, torch_varlen=True, flex=True) == "spans"


def test_forcing(monkeypatch):
    monkeypatch.setenv(pk.FORCE_ENV, "flex")
    assert pk.choose_packed_backend(CPU, FP32) == "flex"
    with pk.force_backend("varlen_reference"):
        assert pk.choose_packed_backend(CUDA, BF16, flash_attn=True) == "varlen_reference"
    monkeypatch.setenv(pk.FORCE_ENV, "math")
    with pytest.raises(ValueError):
        pk.choose_packed_backend(CPU, FP32)
    with pytest.raises(ValueError), pk.force_backend("sdpa"):
        pass


def test_torch_varlen_keywords_follow_the_signature(monkeypatch):
    """torch releases name causality `is_causal` or `window_size` and may lack `enable_gqa` / `scale`: the call
    adapts (the scale folded into the queries) and stays causal bottom-right, GQA passed as it is."""
    import torch.nn.attention.varlen as tv

    spans = make_spans([3, 2, 1], [None, 0, 0])
    lay = pk.build_layout(spans, CPU, "varlen")
    q, k, v = (x.detach() for x in qkv(6, 4, 2))
    ref = per_span(spans, q, k, v, 0.3)
    seen = []

    def old_api(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append((key.shape[1], is_causal))
        return pk.varlen_reference(query, key, value, cu_seq_q.tolist(), cu_seq_k.tolist(), None)

    def new_api(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
        seen.append((key.shape[1], window_size, enable_gqa))
        return pk.varlen_reference(query, key, value, cu_seq_q.tolist(), cu_seq_k.tolist(), scale)

    for api in (old_api, new_api):
        monkeypatch.setattr(tv, "varlen_attn", api)
        pk._varlen_params.cache_clear()
        assert (pk.attend(lay, q, k, v, 0.3) - ref).abs().max() < 1e-5
    pk._varlen_params.cache_clear()
    assert seen == [(2, True), (2, (-1, 0), True)]


def test_torch_varlen_is_left_out_where_it_would_run_cudnn(monkeypatch):
    import torch.nn.attention.varlen as tv

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(tv, "_should_use_cudnn", lambda index: False, raising=False)
    assert pk.torch_varlen_available(CUDA)
    monkeypatch.setattr(tv, "_should_use_cudnn", lambda index: True, raising=False)
    assert not pk.torch_varlen_available(CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(tv, "_should_use_cudnn", lambda index: False, raising=False)
    assert not pk.torch_varlen_available(CUDA)
    assert not pk.torch_varlen_available(CPU)
