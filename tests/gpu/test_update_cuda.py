"""The update's CUDA-only paths: ring attention's fused block kernel (torch's memory-efficient kernel with its
log-sum-exp, bf16 in, fp32 merge) over a simulated three-rank ring against one attention, forward, log-sum-exp and
gradients; the vocabulary-parallel log-prob backward and the asynchronous host-to-device copies without a stream
sync; the LM-head chunk resolved by device. Skipped where no CUDA device is visible; seconds on a GPU."""
import pytest
import torch

import sparserl.actor.ring_attention as ring
from sparserl.actor.context_parallel import zigzag_plan
from sparserl.actor.logprobs import CHUNK_MB_CUDA, chunk_mb_for, host_to_device
from sparserl.actor.vocab_parallel import vocab_parallel_logprobs
from tests.unit.test_ring_kernels import _reference, packed_reference, ring_spans, simulated_ring

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def _qkv(t: int, h: int, hkv: int, d: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return tuple(torch.randn(t, n, d, device=CUDA, generator=g).to(dtype) for n in (h, hkv, hkv))


def test_block_kernel_output_and_lse_on_cuda():
    """One block through the fused kernel in bf16 against fp32 attention on the same (bf16-rounded) inputs, in one
    tile and in tiles of a few rows."""
    assert ring._kind(CUDA) == "cuda"
    q, k, v = _qkv(300, 12, 2, 128)
    mask = torch.rand(300, 260, device=CUDA) < 0.5
    mask[:, 7] = True
    ref, ref_lse = _reference(q.float(), k.float(), v.float(), mask, 128**-0.5)
    for tile in (ring.TILE_BIAS, 40 * 272):
        ring_tile, ring.TILE_BIAS = ring.TILE_BIAS, tile
        try:
            out, lse = ring.block_attention(q, k, v, mask, 128**-0.5)
        finally:
            ring.TILE_BIAS = ring_tile
        assert out.dtype == lse.dtype == torch.float32
        assert (out - ref).abs().max() < 2e-2
        assert (lse - ref_lse).abs().max() < 1e-2


def test_simulated_ring_on_cuda_equals_one_attention():
    """Three ranks' zigzag blocks (prefix spans, padding), the fused kernel per block, merged by log-sum-exp, and the
    LSE-based backward: output and gradients against one fp32 attention over the packed row."""
    spans = ring_spans()
    q, k, v = _qkv(spans[-1].end, 12, 2, 128, seed=1)
    got = simulated_ring(q, k, v, zigzag_plan(spans, 3), 128**-0.5)
    want = packed_reference(q, k, v, spans, 128**-0.5)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max() / b.abs().max().clamp(min=1.0)
        assert err < 3e-2, (name, float(err))


def test_block_kernel_fp32_is_exact_enough():
    """fp32 inputs run the same kernel in fp32: close agreement, forward and backward."""
    q, k, v = _qkv(153, 6, 2, 64, torch.float32, seed=2)
    got = simulated_ring(q, k, v, zigzag_plan(ring_spans(), 2), 0.125)
    for a, b in zip(got, packed_reference(q, k, v, ring_spans(), 0.125)):
        assert (a - b).abs().max() < 1e-3


def test_vocab_parallel_backward_and_copies_do_not_sync():
    logits = torch.randn(64, 1000, device=CUDA, requires_grad=True)
    targets = torch.randint(0, 1500, (64,), device=CUDA)  # some targets belong to another (absent) shard
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, _ = vocab_parallel_logprobs(logits, targets, 0, None)
        logp.sum().backward()
        idx = host_to_device(list(range(100)), CUDA)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert idx.tolist() == list(range(100))
    owned = targets < 1000
    want = -torch.softmax(logits.detach(), -1)
    want[owned.nonzero().squeeze(1), targets[owned]] += 1
    assert (logits.grad - want).abs().max() < 1e-5


def test_chunk_resolves_by_device():
    assert chunk_mb_for(None, CUDA) == CHUNK_MB_CUDA and chunk_mb_for(8, CUDA) == 8.0
