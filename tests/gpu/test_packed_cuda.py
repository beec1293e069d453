"""The single-call packed attention on CUDA (model/packed_kernels.py) against the per-span reference: every kernel
that imports here in bf16 (to 2e-2), flex in fp32 (the one single-call backend that takes fp32, to 1e-5), outputs
and gradients, GQA and MHA, shared prompts on and off, spans of one row; and the model's forward and backward run
with SDPA's math backend switched off, so no call of the chosen path can land there. Skipped without CUDA."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparserl.model import packed_kernels as pk
from tests.unit.test_packed_single_call import (LENGTHS, PREFIXES, close_grads, grouped_seqs, logprobs_and_grads,
                                                make_spans, model, per_span, qkv)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
NO_MATH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 means fp32: no TF32 matmuls in the references or in flex."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def bf16_cases() -> list:
    """Every varlen kernel that imports, GQA and MHA, shared prompts on and off; flex once (in bf16 it is only the
    fallback where no varlen kernel imports, and each compiled shape costs compile time)."""
    have = {"flash_attn": pk.flash_attn_available(), "varlen": torch.cuda.is_available() and pk.torch_varlen_available(CUDA)}
    cases = [pytest.param(b, kv, sh, id=f"{b}-{'gqa' if kv == 2 else 'mha'}-{'shared' if sh else 'unshared'}",
                          marks=pytest.mark.skipif(not ok, reason=f"{b} is not available"))
             for b, ok in have.items() for kv in (2, 4) for sh in (True, False)]
    return cases + [pytest.param("flex", 2, True, id="flex-gqa-shared")]


def near(got, ref, tol) -> bool:
    """Max abs error within `tol` of the reference's scale (at least 1)."""
    got, ref = got.detach().float(), ref.detach()
    return float((got - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max()))


def run(backend, spans, q, k, v, w):
    out = pk.attend(pk.build_layout(spans, CUDA, backend), q, k, v, 0.25)
    return out, torch.autograd.grad((out.float() * w).sum(), (q, k, v))


@pytest.mark.parametrize("backend,kv_heads,shared", bf16_cases())
def test_bf16_kernels_match_the_per_span_reference(backend, kv_heads, shared):
    spans = make_spans(prefixes=PREFIXES if shared else [None] * len(LENGTHS))
    T = spans[-1].end
    q, k, v = qkv(T, 4, kv_heads, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(T, 4, 16, device=CUDA)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]  # the reference in fp32 on the same values
    ref = per_span(spans, *ref_in, 0.25)
    g_ref = torch.autograd.grad((ref * w).sum(), ref_in)
    out, g = run(backend, spans, q, k, v, w)
    assert out.dtype == torch.bfloat16 and near(out, ref, 2e-2)
    for a, b in zip(g, g_ref):
        assert near(a, b, 2e-2)


# Every flex case compiles its kernels (tens of seconds on the first GPU run): one case per claim, GQA with shared
# prompts and MHA without, rather than the full cross product.
FLEX_CASES = [pytest.param(2, True, id="gqa-shared"), pytest.param(4, False, id="mha-unshared")]


@pytest.mark.parametrize("kv_heads,shared", FLEX_CASES)
def test_fp32_flex_matches_the_per_span_reference(kv_heads, shared):
    assert pk.choose_packed_backend(CUDA, torch.float32) == "flex"
    spans = make_spans(prefixes=PREFIXES if shared else [None] * len(LENGTHS))
    T = spans[-1].end
    q, k, v = qkv(T, 4, kv_heads, device=CUDA)
    w = torch.randn(T, 4, 16, device=CUDA)
    ref = per_span(spans, q, k, v, 0.25)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    out, g = run("flex", spans, q, k, v, w)
    assert near(out, ref, 1e-5)
    for a, b in zip(g, g_ref):
        assert near(a, b, 1e-5)


def test_the_cuda_choice_is_one_call():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert pk.choose_packed_backend(CUDA, dtype) in pk.SINGLE_CALL
    assert pk.choose_packed_backend(CUDA, torch.float32) == "flex"


@pytest.mark.parametrize("dtype,tol,kv_heads,share", [
    pytest.param(torch.float32, 1e-5, 2, True, id="fp32-gqa-shared"),  # flex: one compile
    pytest.param(torch.bfloat16, 5e-2, 2, True, id="bf16-gqa-shared"),
    pytest.param(torch.bfloat16, 5e-2, 4, False, id="bf16-mha-unshared")])
def test_model_logprobs_and_gradients_without_sdpa_math(dtype, tol, kv_heads, share):
    """The chosen backend (flex for fp32; flash-attn or torch varlen for bf16 where they import) against the
    per-span path of the same model. bf16 compares two bf16 forwards that round differently, hence the looser bound
    on log-probs of a 120-token vocabulary."""
    m, seqs = model(kv_heads, dtype=dtype, device=CUDA), grouped_seqs()
    with pk.force_backend("spans"):
        lp0, ent0, g0 = logprobs_and_grads(m, seqs, share, device=CUDA)
    with sdpa_kernel(NO_MATH):  # any SDPA call the path made would have to be fused, or raise
        lp, ent, g = logprobs_and_grads(m, seqs, share, device=CUDA)
    assert (lp - lp0).abs().max() < tol and (ent - ent0).abs().max() < tol
    close_grads(g, g0, 1e-5 if dtype == torch.float32 else 5e-2)
