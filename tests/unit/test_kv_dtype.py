"""`rollout.kv_dtype`: quantized KV pools (sparserl/kv/kv_dtype.py) in the native engine.

The round trip's error bounds; attention over an int8 / fp8 pool against the same attention over a float pool that
holds the dequantized values (same math, so equal); the compaction over a quantized pool keeps what it keeps over
the dequantized float pool and moves each entry's scale with it; rollouts with int8 / fp8 KV against a dense
recompute; the bytes an entry costs and the entries a `rollout.kv_memory` holds; bad values as one line.
"""
from types import SimpleNamespace

import pytest
import torch

from sparserl.config.fields import ConfigError
from sparserl.config.load import load_config
from sparserl.engine_options.build import sglang_kv_cache_dtype
from sparserl.engine_options.sizing import SequenceSize, memory_slots, pool_line
from sparserl.utils.kv_memory import entry_bytes
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.sglang.options import SGLangOptions
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.kv.compaction import CompactionState, DueRequest, QueryRing, compact_batch
from sparserl.kv.kv_dtype import KVStore, dequantize, quantize, read_entries, resolve_kv_dtype, write_entries
from sparserl.model.attention import ForwardContext, Span, forward_context, packed_attention
from sparserl.utils.errors import UserError
from tests.conftest import tiny_model
from tests.unit.test_native_engine import PROMPTS, dense_logprobs


def rows(n=64, heads=2, dim=16, seed=0):
    """(n, heads, dim) keys of very different magnitudes per row (as real keys have), one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-3, 2, n)[:, None, None]
    x[3, 1] = 0
    x[5, 0, 2] = 250.0  # an outlier in one channel
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_round_trip_error_is_within_half_a_code_step(kind):
    x = rows()
    codes, scale = quantize(x, kind)
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8) and scale.shape == x.shape[:2]
    back = dequantize(codes, scale, kind, torch.float32)
    err = (back - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        bound = scale[..., None] / 2  # round to nearest: half a step of amax / 127
    else:  # e4m3: 3 mantissa bits (half an ulp is 2**-4 of the magnitude), subnormal steps of 2**-9 x scale
        bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10)
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    assert (err <= amax * (1 / 254 if kind == "int8" else 1 / 16) + 1e-12).all()  # relative to each row's largest
    assert torch.equal(back[3, 1], torch.zeros(16)) and scale[3, 1] == 0  # a zero row stays exactly zero
    assert torch.allclose(back.abs().amax(-1), amax[..., 0], rtol=1e-6, atol=0)  # each row's largest: the top code
    # Read back in bf16: the float32 product rounded once.
    assert torch.equal(dequantize(codes, scale, kind, torch.bfloat16), back.to(torch.bfloat16))


def test_a_store_writes_and_reads_through_the_accessor():
    fmt = resolve_kv_dtype("int8", torch.float32)
    store = fmt.new_layer((10, 2, 16), torch.device("cpu"), zero=True)
    assert isinstance(store, KVStore) and store.shape == (10, 2, 16) and store.dtype == torch.float32
    x = rows()[4:8]
    write_entries(store, torch.tensor([7, 2, 9, 4]), x)
    codes, scale = quantize(x, "int8")
    assert torch.equal(read_entries(store, torch.tensor([2, 9])), dequantize(codes, scale, "int8", torch.float32)[1:3])
    assert read_entries(store, torch.tensor([[7, 2], [9, 4]])).shape == (2, 2, 2, 16)
    assert store.nbytes(10) == 10 * 2 * (16 + 4)
    # In the compute dtype the pool is a plain tensor (auto, or the same dtype by name): the engines' own ops.
    assert isinstance(resolve_kv_dtype("auto", torch.bfloat16).new_layer((4, 2, 16), "cpu", True), torch.Tensor)
    assert resolve_kv_dtype("fp32", torch.float32).plain and not resolve_kv_dtype("bf16", torch.float32).plain


def dequantized_pool(store: KVStore) -> torch.Tensor:
    return read_entries(store, torch.arange(store.shape[0]))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_attention_over_a_quantized_pool_is_attention_over_its_dequantized_values(kind):
    """One packed forward of the registered attention: 3 decode rows over their slots and a prefill span after
    cached entries, against the same forward over a float pool holding the dequantized entries, fed the new keys
    and values as the pool stores them (quantized and back)."""
    g = torch.Generator().manual_seed(1)
    S, H, Hkv, D = 40, 4, 2, 16
    fmt = resolve_kv_dtype(kind, torch.float32)
    k_q, v_q = (fmt.new_layer((S, Hkv, D), torch.device("cpu"), zero=True) for _ in range(2))
    old = torch.arange(1, 30)
    write_entries(k_q, old, torch.randn(29, Hkv, D, generator=g) * 3)
    write_entries(v_q, old, torch.randn(29, Hkv, D, generator=g))
    k_ref, v_ref = dequantized_pool(k_q), dequantized_pool(v_q)
    decode_slots = torch.tensor([[1, 2, 3, 30, 0], [4, 5, 6, 7, 31], [8, 9, 32, 0, 0]])  # each row's new slot last
    lengths = torch.tensor([4, 5, 3])
    bias = torch.zeros(3, 5).masked_fill_(torch.arange(5)[None] >= lengths[:, None], float("-inf"))[:, None, None]
    span_slots = torch.cat([torch.arange(10, 20), torch.tensor([33, 34, 35])])  # 10 cached, 3 new
    T = 3 + 3
    q = torch.randn(1, H, T, D, generator=g)
    k_new, v_new = torch.randn(1, Hkv, T, D, generator=g) * 3, torch.randn(1, Hkv, T, D, generator=g)
    write = torch.tensor([30, 31, 32, 33, 34, 35])

    def run(k_cache, v_cache, k, v):
        ctx = ForwardContext(spans=[Span(3, 6, span_slots, 10)], n_decode=3, decode_slots=decode_slots,
                             decode_bias=bias, write_slots=write, k_cache=[k_cache], v_cache=[v_cache])
        with forward_context(ctx):
            return packed_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=D ** -0.5)[0]

    out_q = run(k_q, v_q, k_new, v_new)

    def as_stored(x):  # (1, Hkv, T, D): what the pool keeps of the new rows
        codes, scale = quantize(x[0].transpose(0, 1), kind)
        return dequantize(codes, scale, kind, torch.float32).transpose(0, 1)[None]

    out_ref = run(k_ref, v_ref, as_stored(k_new), as_stored(v_new))
    assert torch.equal(dequantized_pool(k_q), k_ref) and out_q.shape == (1, T, H, D)
    assert (out_q - out_ref).abs().max() <= 1e-6
    # ... and not attention over the unquantized keys: the pool really is quantized.
    out_float = run(torch.zeros(S, Hkv, D).index_copy_(0, old, k_ref[old]), v_ref.clone(), k_new, v_new)
    assert (out_q - out_float).abs().max() > 1e-4


@pytest.mark.parametrize("policy,share", [("rkv", "head"), ("snapkv", "head"), ("rkv", "layer")])
def test_compaction_of_an_int8_pool_keeps_what_the_dequantized_pool_keeps_and_moves_scales(policy, share):
    g = torch.Generator().manual_seed(2)
    L, S, Hkv, H, D, window = 2, 64, 2, 4, 16, 4
    cfg = KVPolicyConfig(algorithm=policy, budget=12, window=window, divide_length=4, kernel=3, share=share)
    fmt = resolve_kv_dtype("int8", torch.float32)
    k_q = [fmt.new_layer((S, Hkv, D), torch.device("cpu"), zero=True) for _ in range(L)]
    v_q = [fmt.new_layer((S, Hkv, D), torch.device("cpu"), zero=True) for _ in range(L)]
    lengths = [20, 20, 17]  # two requests of one shape (one chunk) and one of another
    slots = [torch.randperm(S - 1, generator=g)[:0] for _ in lengths]
    free = (torch.randperm(S - 1, generator=g) + 1).tolist()
    for i, n in enumerate(lengths):
        slots[i] = torch.tensor([free.pop() for _ in range(n)])
        for layer in range(L):
            write_entries(k_q[layer], slots[i], torch.randn(n, Hkv, D, generator=g) * torch.rand(n, Hkv, 1, generator=g) * 5)
            write_entries(v_q[layer], slots[i], torch.randn(n, Hkv, D, generator=g))
    k_ref, v_ref = [dequantized_pool(b) for b in k_q], [dequantized_pool(b) for b in v_q]
    scales_before = [b.scale.clone() for b in k_q]
    ring = QueryRing(L, len(lengths), window)
    for layer in range(L):
        ring.capture_rows(layer, torch.zeros(len(lengths), H, D), torch.arange(len(lengths)), torch.zeros(len(lengths), dtype=torch.long))
        ring.buffers[layer].copy_(torch.randn(ring.buffers[layer].shape, generator=g))

    def due():
        return [DueRequest(CompactionState(queries_seen=n), i, slots[i], 12, n) for i, n in enumerate(lengths)]

    work_q, work_ref = due(), due()
    kept_q = compact_batch(cfg, ring, work_q, k_q, v_q)
    kept_ref = compact_batch(cfg, ring, work_ref, k_ref, v_ref)
    for a, b in zip(kept_q, kept_ref):
        assert torch.equal(a, b)  # the same logical positions per layer and head
    for i, s in enumerate(slots):
        head = s[:12]
        for layer in range(L):
            assert torch.equal(read_entries(k_q[layer], head), k_ref[layer][head])
            assert torch.equal(read_entries(v_q[layer], head), v_ref[layer][head])
            # Each kept entry's scale is the one it was written with: at the slot that held logical position p.
            src = s[kept_q[i][layer]]  # (H_kv, keep): where each kept entry came from
            assert torch.equal(k_q[layer].scale[head], scales_before[layer].gather(0, src.T))  # (keep, H_kv)
    assert any(not torch.equal(kq, torch.arange(12).expand_as(kq)) for kq in kept_q), "nothing was evicted"


def _engine(kv_dtype="auto", kv=None, **kw):
    return NativeEngine(tiny_model("llama"), num_slots=1024, eos_token_ids=[], kv_dtype=kv_dtype, kv=kv, **kw)


def _generate(engine, n=2, max_new=32):
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n, seed=3)
    return engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("kv_dtype,mean_bound,max_bound", [("int8", 2e-3, 1e-2), ("fp8", 8e-3, 4e-2),
                                                            ("bf16", 1e-3, 5e-3)])
def test_rollouts_over_a_quantized_pool_stay_close_to_the_dense_forward(kv_dtype, mean_bound, max_bound):
    """The sampler's log-probs of its own tokens against the float32 model's recompute (the trainer's mismatch): small,
    and not zero (the pool is what the sampler read). The float32 pool's are exact (test_native_engine.py)."""
    ref = tiny_model("llama")
    gens = _generate(_engine(kv_dtype))
    assert all(len(g.token_ids) == 32 and all(0 <= t < 128 for t in g.token_ids) for g in gens)
    diff = torch.cat([torch.tensor(g.logp_sparse) - dense_logprobs(ref, g, 1.0) for g in gens]).abs()
    assert 1e-6 < diff.mean() < mean_bound and diff.max() < max_bound


def test_the_decode_cache_and_the_gathered_decode_read_the_same_int8_entries():
    on, off = _generate(_engine("int8", decode_cache="on")), _generate(_engine("int8", decode_cache="off"))
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    assert max(abs(a - b) for x, y in zip(on, off) for a, b in zip(x.logp_sparse, y.logp_sparse)) < 1e-5


def test_compressed_rollouts_over_an_int8_pool():
    kv = KVPolicyConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel=3)
    engine = _engine("int8", kv)
    gens = _generate(engine, n=3, max_new=40)
    assert engine.stats().compressions > 0 and engine.pool.num_used == 0
    assert all(len(g.token_ids) == 40 and g.kv.peak_slots <= 16 + 8 for g in gens)
    assert all(all(-float("inf") < lp <= 0 for lp in g.logp_sparse) for g in gens)
    # No sequence is compacted before it holds 17 entries: the first 4 tokens (prompts of at most 13) are the dense
    # int8 run's, through the same quantized prefill.
    dense = _generate(_engine("int8"), n=3, max_new=40)
    for a, b in zip(gens, dense):
        assert a.token_ids[:4] == b.token_ids[:4]
        assert max(abs(x - y) for x, y in zip(a.logp_sparse[:4], b.logp_sparse[:4])) < 1e-5


def test_a_quantized_pool_turns_captured_decode_off(capsys):
    assert _engine("auto", cuda_graphs="on").runner.graphs is not None  # eager static steps on CPU
    engine = _engine("int8", cuda_graphs="on")
    assert engine.runner.graphs is None
    assert "rollout.kv_dtype=int8: decode steps run eagerly" in capsys.readouterr().out


def test_bytes_per_entry_and_the_entries_a_kv_memory_holds(tmp_path):
    for kv_dtype, element, scale in [("auto", 4, 0), ("bf16", 2, 0), ("int8", 1, 4), ("fp8", 1, 4)]:
        engine = NativeEngine(tiny_model("llama"), num_slots=8, kv_dtype=kv_dtype)
        per_entry = entry_bytes(2, 2, 16, element, scale)  # tiny: 2 layers, 2 KV heads, head dim 16
        assert engine.stats().kv_bytes_per_slot == per_entry
        pool = engine.runner.k_cache + engine.runner.v_cache
        held = sum(t.nbytes(8) if isinstance(t, KVStore) else t[:8].nbytes for t in pool)
        assert held == 8 * per_entry  # what the engine says an entry costs is what its tensors take
    # A model with head dim 64 (most real ones): int8 holds 256 / 68 of fp32's entries, 128 / 68 of bf16's.
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    longest = SequenceSize(30, 64)

    def slots(*over):
        return memory_slots(load_config(["rollout.kv_memory=8MB", *over]), str(tmp_path), torch.device("cpu"), longest)

    fp32, bf16 = slots("rollout.dtype=float32"), slots("rollout.dtype=bfloat16")
    int8 = slots("rollout.dtype=float32", "rollout.kv_dtype=int8")
    assert int8 == slots("rollout.dtype=bfloat16", "rollout.kv_dtype=int8") == 8 * 2**20 // (2 * 2 * 2 * 68)
    assert 3.7 < int8 / fp32 < 3.8 and 1.85 < int8 / bf16 < 1.9
    line = pool_line(load_config(["rollout.kv_dtype=int8"]), int8, 2 * 2 * 2 * 68, longest)
    assert line.startswith(f"KV pool 8.0 MB (kv_dtype int8 + a float32 scale per token and KV head) = {int8} entries")


def test_bad_kv_dtypes_are_one_line():
    with pytest.raises(ConfigError, match="rollout.kv_dtype=int4: must be one of auto, bf16, fp16, fp32, int8, fp8"):
        load_config(["rollout.kv_dtype=int4"])
    with pytest.raises(ConfigError, match="rollout.kv_dtype=int8 with rollout.engine=sglang: SGLang has no int8 KV"):
        load_config(["rollout.kv_dtype=int8", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="rollout.kv_dtype=fp8 with rollout.engine=sglang and rollout.kv.algorithm=rkv"):
        load_config(["rollout.kv_dtype=fp8", "rollout.engine=sglang", "+preset=sparse_rl"])
    with pytest.raises(ValueError, match="rollout.kv_dtype='int4'"):
        NativeEngine(tiny_model("llama"), num_slots=8, kv_dtype="int4")
    # SGLang's kv_cache_dtype: its names where its pool takes the dtype, one line where not.
    assert sglang_kv_cache_dtype("fp8", "bfloat16", on_gpu=True) == "fp8_e4m3"
    assert sglang_kv_cache_dtype("auto", "bfloat16", on_gpu=True) is None
    assert sglang_kv_cache_dtype("fp32", "float32", on_gpu=False) is None  # the model's dtype: SGLang's auto
    with pytest.raises(UserError, match="rollout.kv_dtype=fp8 with rollout.engine=sglang needs CUDA"):
        sglang_kv_cache_dtype("fp8", "bfloat16", on_gpu=False)
    with pytest.raises(UserError, match="SGLang's kv_cache_dtype takes auto"):
        sglang_kv_cache_dtype("fp16", "float32", on_gpu=True)
    args = SGLangOptions(kv_cache_dtype="fp8_e4m3").server_args("m", 0)
    assert args["kv_cache_dtype"] == "fp8_e4m3" and "kv_cache_dtype" not in SGLangOptions().server_args("m", 0)
