"""The paged decode attention kernel against two references: the module's own torch reference and an
independent one (per row and KV head, gather the row's slots and run SDPA). On CPU the kernel runs under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU); on a GPU machine the same
cases run the compiled kernel. Shapes are small so that the interpreter stays quick."""
import pytest
import torch
import torch.nn.functional as F

from sparserl.kernels import paged_decode as pd
from sparserl.kernels.paged_decode import kernel_available, paged_decode_attention, reference_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not kernel_available(DEVICE), reason="the kernel needs triton, and on CPU "
                                  "TRITON_INTERPRET=1 set before sparserl.kernels.paged_decode is imported")


def sdpa_reference(q, k_pool, v_pool, table, lengths, scale=None):
    """Independent oracle: a loop over rows and KV heads, gathering each head's entries and calling SDPA."""
    B, H, D = q.shape
    hkv = k_pool.shape[1]
    G = H // hkv
    lens = lengths[:, None].expand(B, hkv) if lengths.dim() == 1 else lengths
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(hkv):
            n = int(lens[b, h])
            if n == 0:
                continue
            slots = table[b, :n].long()
            k, v = k_pool[slots, h].float()[None], v_pool[slots, h].float()[None]  # (1, n, D)
            qs = q[b, h * G:(h + 1) * G].float()[None]  # (1, G, D)
            out[b, h * G:(h + 1) * G] = F.scaled_dot_product_attention(qs, k, v, scale=scale)[0]
    return out


def make_case(B, H, hkv, D, W, lengths, seed=0, dtype=torch.float32, table_dtype=torch.int32, slots=None):
    g = torch.Generator().manual_seed(seed)
    S = slots or B * W + 17
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k_pool = torch.randn(S, hkv, D, generator=g).to(dtype)
    v_pool = torch.randn(S, hkv, D, generator=g).to(dtype)
    table = torch.randperm(S, generator=g)[: B * W].view(B, W).to(table_dtype)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    # Entries past a row's length are never read: point them far outside the pool to prove it.
    cols = torch.arange(W)[None, :]
    past = cols >= (lengths if lengths.dim() == 1 else lengths.max(1).values)[:, None]
    table = table.masked_fill(past, 10**6)
    return [t.to(DEVICE) for t in (q, k_pool, v_pool, table, lengths)]


def assert_matches(out, q, k_pool, v_pool, table, lengths, atol=1e-5, scale=None):
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference_decode_attention(q, k_pool, v_pool, table, lengths, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(out.float(), sdpa_reference(q, k_pool, v_pool, table, lengths, scale), atol=atol,
                               rtol=atol)


@needs_kernel
@pytest.mark.parametrize("heads", [(9, 3), (12, 2), (4, 4)], ids=["gqa9/3", "gqa12/2", "mha"])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_ragged_rows_over_several_splits(heads, table_dtype):
    H, hkv = heads
    lengths = [0, 1, 40, 17, 33]  # empty and one-entry rows; 40 = W spans three splits of 16
    case = make_case(5, H, hkv, 16, 40, lengths, table_dtype=table_dtype)
    out = paged_decode_attention(*case, block_n=16, split_len=16)
    assert_matches(out, *case)
    assert out[0].abs().max() == 0  # a row of length 0 is zero


@needs_kernel
def test_one_split_and_default_config():
    case = make_case(3, 8, 2, 32, 24, [24, 5, 0], seed=1)
    assert_matches(paged_decode_attention(*case, block_n=16, split_len=64), *case)  # one split: no merge
    assert_matches(paged_decode_attention(*case, scale=0.3), *case, scale=0.3)


@needs_kernel
def test_long_rows_with_the_default_splits():
    W = 600
    block_n, split_len, num_splits = pd._launch_config(2, 2, 16, W, None, None)
    assert num_splits > 1 and split_len % block_n == 0 and split_len * num_splits >= W
    case = make_case(2, 6, 2, 16, W, [600, 300], seed=2)
    assert_matches(paged_decode_attention(*case), *case)


@needs_kernel
def test_many_splits_merge_in_blocks():
    """19 splits: the merge reads them 16 at a time (two blocks, the second partial), empty splits included."""
    case = make_case(2, 2, 1, 16, 300, [300, 70], seed=8)
    block_n, split_len, num_splits = pd._launch_config(2, 1, 16, 300, 16, 16)
    assert num_splits == 19 > pd.MERGE_SPLIT_BLOCK
    assert_matches(paged_decode_attention(*case, block_n=16, split_len=16), *case)


@needs_kernel
def test_head_dim_64():
    case = make_case(2, 8, 2, 64, 48, [48, 20], seed=3)
    assert_matches(paged_decode_attention(*case, block_n=16, split_len=32), *case)


@needs_kernel
def test_per_head_lengths():
    lengths = [[0, 3], [16, 9], [1, 1], [30, 0]]  # genuinely different counts per KV head
    case = make_case(4, 6, 2, 16, 30, lengths, seed=4)
    assert_matches(paged_decode_attention(*case, block_n=16, split_len=16), *case)
    q, k_pool, v_pool, table, lens = case
    strided = lens.t().contiguous().t()  # a (B, H_kv) view with other strides reads the same lengths
    assert_matches(paged_decode_attention(q, k_pool, v_pool, table, strided, block_n=16, split_len=16), *case)


@needs_kernel
def test_per_head_compaction_like_rkv():
    """Each KV head keeps its own `keep` tokens of a row's uncompacted cache, compacted into the row's first
    `keep` slots (same count, different tokens per head): attention equals SDPA over the kept tokens."""
    g = torch.Generator().manual_seed(5)
    B, H, hkv, D, T, keep = 3, 9, 3, 16, 50, 20
    full_k, full_v = torch.randn(B, T, hkv, D, generator=g), torch.randn(B, T, hkv, D, generator=g)
    kept = torch.stack([torch.stack([torch.randperm(T, generator=g)[:keep].sort().values for _ in range(hkv)])
                        for _ in range(B)])  # (B, H_kv, keep)
    table = torch.randperm(B * keep + 8, generator=g)[: B * keep].view(B, keep)
    k_pool, v_pool = torch.zeros(B * keep + 8, hkv, D), torch.zeros(B * keep + 8, hkv, D)
    for b in range(B):
        for h in range(hkv):
            k_pool[table[b], h] = full_k[b, kept[b, h], h]
            v_pool[table[b], h] = full_v[b, kept[b, h], h]
    q = torch.randn(B, H, D, generator=g)
    lengths = torch.full((B,), keep)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, table, lengths)]
    out = paged_decode_attention(*args, block_n=16, split_len=16).cpu()
    G = H // hkv
    for b in range(B):
        for h in range(hkv):
            k, v = full_k[b, kept[b, h], h], full_v[b, kept[b, h], h]
            want = F.scaled_dot_product_attention(q[b, h * G:(h + 1) * G][None], k[None], v[None])[0]
            torch.testing.assert_close(out[b, h * G:(h + 1) * G], want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_bf16_close_to_fp32():
    case = make_case(3, 8, 2, 32, 40, [40, 7, 0], seed=6, dtype=torch.bfloat16, table_dtype=torch.int64)
    out = paged_decode_attention(*case, block_n=16, split_len=16)
    assert out.dtype == torch.bfloat16
    fp32 = [t.float() if t.is_floating_point() else t for t in case]
    torch.testing.assert_close(out.float(), reference_decode_attention(*fp32), atol=3e-2, rtol=3e-2)


@needs_kernel
@pytest.mark.parametrize("split_len", [None, 32], ids=["default", "3-splits"])
def test_engine_shape_qwen25_1p5b(split_len):
    """What the GPU check's model launches in the static step: 12 query heads over 2 KV heads, D = 128, bf16 pools,
    an int32 table and int64 lengths, padding rows of length 0; the default launch and one with splits."""
    case = make_case(4, 12, 2, 128, 96, [96, 41, 0, 1], seed=9, dtype=torch.bfloat16)
    out = paged_decode_attention(*case, split_len=split_len)
    fp32 = [t.float() if t.is_floating_point() else t for t in case]
    torch.testing.assert_close(out.float(), reference_decode_attention(*fp32), atol=2e-2, rtol=2e-2)
    assert out[2].abs().max() == 0


@needs_kernel
def test_strided_query_and_out_of_range_lengths():
    q, k_pool, v_pool, table, lengths = make_case(3, 4, 2, 16, 20, [20, 4, 0], seed=7)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # q as a strided slice of a wider projection
    wide = qkv[:, :4]
    assert not wide.is_contiguous()
    assert_matches(paged_decode_attention(wide, k_pool, v_pool, table, lengths, block_n=16), q, k_pool, v_pool,
                   table, lengths)
    clamped = torch.tensor([25, 4, -3], device=DEVICE)  # past W reads W entries; negative reads none
    out = paged_decode_attention(q, k_pool, v_pool, table, clamped, block_n=16, split_len=16)
    torch.testing.assert_close(out, reference_decode_attention(q, k_pool, v_pool, table, lengths), atol=1e-5,
                               rtol=1e-5)


@needs_kernel
def test_unsupported_head_size_raises():
    case = make_case(1, 2, 1, 24, 8, [8])
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(*case)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(*make_case(1, 2, 1, 16, 8, [8]), block_n=8)


def test_bad_shapes_raise():
    q, k_pool, v_pool, table, lengths = make_case(2, 6, 4, 16, 8, [8, 8])
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_decode_attention(q, k_pool, v_pool, table, lengths)
    q, k_pool, v_pool, table, lengths = make_case(2, 4, 2, 16, 8, [8, 8])
    with pytest.raises(ValueError, match="slot_table"):
        paged_decode_attention(q, k_pool, v_pool, table.float(), lengths)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention(q, k_pool, v_pool, table, lengths[:, None].expand(2, 3))


def test_cpu_without_the_interpreter_falls_back_to_the_reference(monkeypatch):
    """A CPU call without the interpreter runs the torch reference (same contract), never the kernel."""
    monkeypatch.setattr(pd, "_INTERPRETED", False)
    assert not kernel_available("cpu")

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run")

    monkeypatch.setattr(pd, "_split_kernel", no_kernel, raising=False)
    q, k_pool, v_pool, table, lengths = (t.cpu() for t in make_case(3, 6, 2, 24, 12, [12, 0, 5]))  # any D
    out = paged_decode_attention(q, k_pool, v_pool, table, lengths)
    torch.testing.assert_close(out, sdpa_reference(q, k_pool, v_pool, table, lengths), atol=1e-5, rtol=1e-5)


@pytest.fixture
def fresh_probe():
    """The launch probe runs again (it is cached per device and process), and again after the test."""
    from triton.runtime import build

    def clear():
        pd.launch_problem.cache_clear()
        if hasattr(build, "_find_compiler"):  # triton >= 3.7 caches the compiler it found
            build._find_compiler.cache_clear()

    clear()
    yield clear
    clear()


@pytest.mark.skipif(pd.triton is None, reason="needs triton")
def test_a_failing_triton_build_step_turns_the_kernel_off(monkeypatch, caplog, tmp_path, fresh_probe):
    """Triton builds its launcher with the host's C compiler at the first launch. With no compiler (CC names a
    missing one, as a machine without gcc), its real build step raises: the probe says so in one line, the kernel is
    off for CUDA and the static step's attention takes SDPA. With the machine's own compiler the build passes."""
    from sparserl.engines.native.static_attention import StaticDecodeAttention

    assert pd.build_problem() is None  # gcc and Python.h here: the real build step passes
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_probe()
    problem = pd.build_problem()
    assert problem is not None and "build step" in problem and "no-such-cc" in problem
    with caplog.at_level("WARNING", logger=pd.__name__):
        assert not kernel_available("cuda:0")
        assert StaticDecodeAttention(torch.device("cuda", 0), 128).use_kernel is False
        assert not kernel_available("cuda:0")
    said = [r.getMessage() for r in caplog.records if "paged decode kernel off" in r.getMessage()]
    assert len(said) == 1 and "build step" in said[0] and "SDPA" in said[0]  # one line, once per device
    assert kernel_available("cpu") == pd._INTERPRETED  # the interpreter builds nothing
