"""`rollout.prepack`: linear weights packed for the decode batch change nothing but speed and memory.

The engine scenarios run on the same tiny fp32 model with each packed kernel (oneDNN's, MKL's) and with plain GEMMs,
and must give the same tokens and log-probs: a batch that shrinks as sequences finish at EOS (MKL: packed again as it
shrinks, zero-padded in between, plain GEMMs below 4 rows; oneDNN: one packing for every size; prefill forwards plain),
and weights that change under the packed copies (a sync).
"""
import pytest
import torch
import torch.nn.functional as F

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.prepack import (MIN_ROWS, PackedLinear, Prepacker, available_kernels, default_kernel,
                                             prepack_available, resolve_prepack, serves_from)
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.utils.errors import UserError
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch has no packed GEMM")
KERNELS = available_kernels()

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6], [9, 8, 7, 6, 5, 4, 3],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logp_sparse), torch.tensor(y.logp_sparse), rtol=0, atol=1e-5)


def requests(n=4, tokens=24):
    return [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=tokens + 2 * i, seed=i, n=n), i)
            for i, p in enumerate(PROMPTS)]


def engine(setting, model=None, **kw):
    return NativeEngine(model or tiny_model("llama"), num_slots=4096, prepack=setting, **kw)


@pytest.mark.parametrize("kernel", KERNELS)
def test_shrinking_batch_same_tokens_and_logprobs(kernel):
    # 24 sequences; EOS ends them at different steps, so the decode batch shrinks from 24 to 4 and below.
    reqs = requests()
    eos = [7, 9, 11]
    on_engine = engine(kernel, eos_token_ids=eos)
    on, off = on_engine.generate(reqs), engine("off", eos_token_ids=eos).generate(reqs)
    assert_same(on, off)
    lengths = sorted(len(g.token_ids) for g in on)
    assert lengths[0] < lengths[len(lengths) // 2] < lengths[-1], "the sequences should end at different steps"
    p = on_engine.runner.prepacker
    assert p.kernel == kernel
    if kernel == "mkl":
        assert p.packed_forwards >= 10 and p.packs >= 2, (p.packed_forwards, p.packs)
    else:  # one oneDNN packing serves every batch size, down to one row
        assert p.packed_forwards >= 20 and p.packs == 1, (p.packed_forwards, p.packs)
    assert engine("off").runner.prepacker is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_weights_synced_under_packed_copies(kernel):
    # Pack, then load new weights and release/reload them: the next decode must use the new weights.
    reqs = requests(n=3, tokens=12)
    on_engine, off_engine = engine(kernel, eos_token_ids=[]), engine("off", eos_token_ids=[])
    assert_same(on_engine.generate(reqs), off_engine.generate(reqs))
    assert on_engine.runner.prepacker.nbytes > 0
    torch.manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in tiny_model("llama").named_parameters()]
    on_engine.runner.release_weights()
    assert on_engine.runner.prepacker.nbytes == 0, "released weights drop their packed copies"
    for e in (on_engine, off_engine):
        e.update_weights(new)
    after_on, after_off = on_engine.generate(reqs), off_engine.generate(reqs)
    assert_same(after_on, after_off)
    # And an in-place change without a release (the version counter marks the packing stale).
    with torch.no_grad():
        for e in (on_engine, off_engine):
            e.runner.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    assert_same(on_engine.generate(reqs), off_engine.generate(reqs))


@pytest.mark.skipif("mkl" not in KERNELS, reason="this torch has no MKL packed GEMM")
def test_packed_linear_padding_and_fallback():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40, bias=True))
    layer = model[0]
    packer = Prepacker(model, "mkl")
    assert isinstance(layer, PackedLinear) and list(dict(model.named_parameters())) == ["0.weight", "0.bias"]
    packer.prepare(32)
    assert packer.armed and packer.rows == 32
    assert serves_from(32) == 28 and serves_from(64) == 56 and serves_from(8) == 4
    for rows in (28, 30, 32):  # 28..32: the packing serves them, padded
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-6)
    packer.prepare(30)
    assert packer.rows == 32 and packer.packs == 1, "a batch within the band reuses the packing"
    packer.prepare(20)
    assert packer.rows == 20 and packer.packs == 2
    packer.prepare(24)
    assert packer.rows == 24 and packer.packs == 3, "a larger batch is packed for its own size"
    x = torch.randn(33, 48)  # rows the packing does not serve: the plain GEMM, exactly
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    packer.prepare(MIN_ROWS - 1)
    assert not packer.armed
    packer.disarm()
    x = torch.randn(20, 48)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif("onednn" not in KERNELS, reason="this torch has no oneDNN packed GEMM")
def test_onednn_packing_serves_every_size():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40, bias=True), torch.nn.Linear(40, 24, bias=False))
    packer = Prepacker(model, "onednn")
    for rows in (64, 1, 3, 17, 64, 200):
        packer.prepare(rows)
        assert packer.armed and packer.packs == 1, "packed once, for any batch"
        x = torch.randn(1, rows, 48)
        h = model[0](x)
        torch.testing.assert_close(h, F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model[1](h), F.linear(h, model[1].weight), rtol=1e-5, atol=1e-5)
    packer.prepare(0)  # a forward with prefill rows: plain GEMMs, exactly
    assert not packer.armed
    x = torch.randn(20, 48)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_setting_resolution():
    cpu = torch.device("cpu")
    assert resolve_prepack("auto", cpu, torch.float32, "none") == default_kernel() in KERNELS
    assert resolve_prepack("on", cpu, torch.float32, "none") == default_kernel()
    # MKL's packed GEMM on Intel CPUs, oneDNN's elsewhere (and whichever this torch has, if only one).
    assert default_kernel(["onednn", "mkl"], "GenuineIntel") == "mkl"
    assert default_kernel(["onednn", "mkl"], "AuthenticAMD") == "onednn"
    assert default_kernel(["onednn", "mkl"], "") == "onednn"
    assert default_kernel(["onednn"], "GenuineIntel") == "onednn"
    assert default_kernel(["mkl"], "AuthenticAMD") == "mkl"
    assert default_kernel([], "GenuineIntel") is None
    for kernel in KERNELS:
        assert resolve_prepack(kernel, cpu, torch.float32, "none") == kernel
    assert resolve_prepack("auto", cpu, torch.bfloat16, "none") is None
    assert resolve_prepack("auto", cpu, torch.float32, "int8") is None
    assert resolve_prepack("auto", torch.device("cuda"), torch.float32, "none") is None
    assert resolve_prepack("off", cpu, torch.float32, "none") is None
    with pytest.raises(UserError, match="rollout.prepack=on needs a CPU engine in float32"):
        resolve_prepack("on", cpu, torch.bfloat16, "none")
    with pytest.raises(UserError, match="rollout.prepack=onednn needs a CPU engine in float32"):
        resolve_prepack("onednn", torch.device("cuda"), torch.float32, "none")
    with pytest.raises(ValueError, match="auto, on, off, onednn, mkl"):
        resolve_prepack("yes", cpu, torch.float32, "none")
    # A bf16 engine resolves auto to plain GEMMs.
    assert engine("auto", tiny_model("llama", dtype=torch.bfloat16)).runner.prepacker is None


def test_a_dropped_engine_is_freed_without_the_garbage_collector():
    # The packed layers share a state object instead of pointing back at their Prepacker: no reference cycle, so
    # the weights, their packed copies and the KV pool go as soon as the engine does (not at some later gc pass).
    import gc
    import weakref

    gc.disable()
    try:
        e = engine(KERNELS[0], eos_token_ids=[])
        e.generate(requests(n=4, tokens=6))
        assert e.runner.prepacker.packs >= 1
        layer = weakref.ref(e.runner.prepacker.layers[0])
        del e
        assert layer() is None
    finally:
        gc.enable()


class _Block(torch.nn.Module):
    """An attention layer's and a gated MLP's projections, named as in Llama / Qwen2 (q/k/v with biases here)."""

    def __init__(self, hidden=48, kv=16, inter=80, bias=True):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(hidden, hidden, bias=bias), torch.nn.Linear(hidden, kv, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.gate_proj, self.up_proj = torch.nn.Linear(hidden, inter, bias=False), torch.nn.Linear(hidden, inter, bias=False)


@pytest.mark.skipif("onednn" not in KERNELS, reason="this torch has no oneDNN packed GEMM")
@pytest.mark.parametrize("bias", [True, False])
def test_sibling_projections_run_as_one_gemm_with_the_same_bits(bias):
    torch.manual_seed(0)
    fused_block, plain_block = _Block(bias=bias), _Block(bias=bias)
    plain_block.load_state_dict(fused_block.state_dict())
    fused, plain = Prepacker(fused_block, "onednn"), Prepacker(plain_block, "onednn", fuse=False)
    assert len(fused.groups) == 2 and plain.groups == []
    for rows in (1, 5, 64):
        fused.prepare(rows), plain.prepare(rows)
        assert fused.nbytes == plain.nbytes > 0
        x = torch.randn(1, rows, 48)
        with torch.inference_mode():
            for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                for name in names:  # the leader first, then each follower takes its columns of the one GEMM
                    out, ref = getattr(fused_block, name)(x), getattr(plain_block, name)(x)
                    assert torch.equal(out, ref), name
                    layer = getattr(plain_block, name)
                    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        fused.disarm(), plain.disarm()
    assert fused.packs == 1
    # A follower run on another input, or a second time on the same one, runs its own plain GEMM: exactly F.linear.
    fused.prepare(8)
    x, other = torch.randn(8, 48), torch.randn(8, 48)
    fused_block.q_proj(x)
    assert torch.equal(fused_block.k_proj(other), F.linear(other, fused_block.k_proj.weight, fused_block.k_proj.bias))
    fused_block.k_proj(x)
    assert torch.equal(fused_block.k_proj(x), F.linear(x, fused_block.k_proj.weight, fused_block.k_proj.bias))
    # Outside inference mode an input changed in place since the leader ran is not the leader's input any more.
    fused_block.gate_proj(x)
    x.mul_(2.0)
    assert torch.equal(fused_block.up_proj(x), F.linear(x, fused_block.up_proj.weight))
    # A changed weight is packed again, fused.
    with torch.no_grad():
        fused_block.v_proj.weight.add_(1.0)
    fused.disarm()
    fused.prepare(8)
    assert fused.packs == 2
    fused_block.q_proj(x), fused_block.k_proj(x)
    torch.testing.assert_close(fused_block.v_proj(x), F.linear(x, fused_block.v_proj.weight, fused_block.v_proj.bias),
                               rtol=1e-5, atol=1e-5)
    fused.disarm()
    assert fused.groups[0][0].outputs == [], "nothing of a forward is held after it"


@pytest.mark.skipif("onednn" not in KERNELS, reason="this torch has no oneDNN packed GEMM")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_projections_give_the_engine_the_same_bits(family, monkeypatch):
    # A real decoder (Qwen2: q/k/v with biases) through the engine: packed with its q/k/v and gate/up fused, and
    # packed one weight at a time, the same tokens and bitwise the same log-probs.
    from sparserl.engines.native import prepack

    reqs = requests(n=3, tokens=16)
    fused_engine = engine("onednn", tiny_model(family), eos_token_ids=[])
    assert len(fused_engine.runner.prepacker.groups) == 2 * 2  # two layers, two groups each
    fused = fused_engine.generate(reqs)
    monkeypatch.setattr(prepack, "FUSED_GROUPS", ())
    apart_engine = engine("onednn", tiny_model(family), eos_token_ids=[])
    assert apart_engine.runner.prepacker.groups == []
    apart = apart_engine.generate(reqs)
    for a, b in zip(fused, apart):
        assert a.token_ids == b.token_ids and a.logp_sparse == b.logp_sparse
    assert_same(fused, engine("off", tiny_model(family), eos_token_ids=[]).generate(reqs))
