"""The native engine's decode-only steps captured as CUDA graphs (`rollout.cuda_graphs`): replays equal the same
static step run uncaptured, stay close to the eager engine, count their captures, and neither the step nor the draw
synchronizes with the host beyond its one event wait. Skipped where no CUDA device is visible."""
import pytest
import torch

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kernels import paged_decode
from sparserl.kv import KVPolicyConfig
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
RKV = KVPolicyConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel=3, sinks=2)


@pytest.fixture(autouse=True)
def exact_fp32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def make(graphs, family="llama", dtype=torch.float32, kv=None, max_num_seqs=5):
    model = tiny_model(family, dtype=dtype).to(CUDA)
    return NativeEngine(model, num_slots=2048, eos_token_ids=[], kv=kv, cuda_graphs=graphs, max_num_seqs=max_num_seqs)


def rollout(engine, max_new=(24, 40, 31, 27, 36)):
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=max_new[i], n=1 + i % 2, seed=11), i)
            for i, p in enumerate(PROMPTS)]
    return engine.generate(reqs)


def worst_logp_gap(a, b):
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logp_sparse, y.logp_sparse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,kv", [("llama", None), ("qwen2", None), ("llama", RKV)])
def test_replayed_steps_equal_the_uncaptured_static_step(family, kv, dtype):
    captured, uncaptured = make("on", family, dtype, kv), make("on", family, dtype, kv)
    uncaptured.runner.graphs.capture = False  # the same buffers, kernels and table width, run eagerly
    a, b = rollout(uncaptured), rollout(captured)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
    assert worst_logp_gap(a, b) < 1e-6
    graphs = captured.runner.graphs
    assert graphs.captures == len(graphs.graphs) >= 3  # one per bucket met: 5, 4, 2, 1 rows as the batch drains
    assert captured.stats().extra["rollout/graph_captures"] == graphs.captures
    assert captured.stats().extra["rollout/graph_capture_s"] == graphs.capture_s > 0
    assert graphs.waits > 30 and uncaptured.runner.graphs.waits == graphs.waits  # one event wait per static step


@pytest.mark.parametrize("family,kv", [("llama", None), ("qwen2", None), ("llama", RKV)])
def test_captured_engine_matches_the_eager_engine_in_fp32(family, kv):
    a, b = rollout(make("off", family, kv=kv)), rollout(make("on", family, kv=kv))
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
    assert worst_logp_gap(a, b) < 1e-4


def test_captured_engine_stays_close_to_the_eager_engine_in_bf16():
    # bf16 rounds the paged kernel and the eager gather differently: a draw may flip, so compare up to the first
    # token where a sequence's samples part.
    a, b = rollout(make("off", dtype=torch.bfloat16)), rollout(make("on", dtype=torch.bfloat16))
    same = 0
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        same += k == len(x.token_ids)
        assert all(abs(p - q) < 5e-2 for p, q in zip(x.logp_sparse[:k], y.logp_sparse[:k]))
    assert same >= len(a) // 2


def test_decode_steps_and_draw_do_not_sync_and_recapture_after_sleep():
    engine = make("on", kv=RKV)
    rollout(engine)  # captures the buckets this rollout meets
    graphs = engine.runner.graphs
    captured = graphs.captures
    step = graphs.step
    checked = [0]

    def strict(seqs, *args, **kw):
        size = next(b for b in graphs.sizes if b >= len(seqs))
        if size not in graphs.graphs:  # a capture synchronizes on purpose
            return step(seqs, *args, **kw)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step(seqs, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked[0] += 1
        return out

    graphs.step = strict
    try:
        rollout(engine)
    finally:
        del graphs.step
    assert checked[0] > 30 and graphs.captures == captured  # the same buckets: replays only
    # Sleep drops the pool (and the graphs over it); the next rollout captures again.
    engine.sleep()
    engine.wake()
    rollout(engine)
    assert graphs.captures > captured


def test_the_kernel_probe_passes_here_and_the_step_takes_the_kernel():
    """The launch probe (gcc and Python.h for triton's launcher, one tiny launch of both kernels) on this machine."""
    assert paged_decode.launch_problem(torch.device("cuda", torch.cuda.current_device())) is None
    engine = make("on", dtype=torch.bfloat16)
    assert engine.runner.graphs.attention.use_kernel  # tiny_model's head size 16: a power of two the kernel takes


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_the_second_device_while_the_first_is_current():
    """The step enters its engine's device: the event it waits on and the capture are on cuda:1, so tokens are read
    after their copy lands; the rollout equals the same one on cuda:0."""
    torch.cuda.set_device(0)
    on0 = rollout(make("on"))
    model = tiny_model("llama").to("cuda:1")
    engine = NativeEngine(model, num_slots=2048, eos_token_ids=[], cuda_graphs="on", max_num_seqs=5)
    on1 = rollout(engine)
    assert torch.cuda.current_device() == 0
    assert [g.token_ids for g in on1] == [g.token_ids for g in on0]
    assert engine.runner.graphs.captures > 0
