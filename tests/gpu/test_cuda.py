"""The paths only a GPU runs: the native engine on CUDA (against transformers on the same device and against the
CPU engine), the draw without host syncs, the GPU-only quantization schemes, memory released on sleep, and the
trainer on CUDA with NCCL. Skipped where no CUDA device is visible (CI); `scripts/gpu_check.sh` runs them with the
rest of the GPU checks, and docs/gpu.md records what they gave on which machine."""
import pytest
import torch

from sparserl.engines.draw import RowSettings, sample
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.model.sampling import processed_logprobs
from tests.conftest import tiny_model
from tests.e2e.test_trainer import FAILING_ENV, read_metrics, trainer, write_data
from tests.unit.test_native_engine import PROMPTS, dense_logprobs, requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 means fp32: no TF32 matmuls while these tests compare devices."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_on_cuda_matches_transformers_generate_on_cuda(family):
    ref = tiny_model(family).to(CUDA)
    engine = NativeEngine(tiny_model(family).to(CUDA), num_slots=512, eos_token_ids=[])
    gens = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16)))
    for p, g in zip(PROMPTS, gens):
        out = ref.generate(torch.tensor([p], device=CUDA), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        assert g.token_ids == out[0, len(p):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sampled_rollouts_are_the_same_on_cuda_and_cpu(family):
    """The draw is keyed by (seed, position), not by a device generator: the same seed samples the same tokens on
    both devices, and the sampler's log-probs agree with a dense forward on CUDA to fp32 rounding."""
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=3, seed=7)
    cpu = NativeEngine(tiny_model(family), num_slots=1024, eos_token_ids=[]).generate(requests(params))
    gpu = NativeEngine(tiny_model(family).to(CUDA), num_slots=1024, eos_token_ids=[]).generate(requests(params))
    assert [g.token_ids for g in gpu] == [g.token_ids for g in cpu]
    ref = tiny_model(family).to(CUDA)
    worst = max((dense_logprobs(ref, g, 1.0) - torch.tensor(g.logp_sparse)).abs().max().item() for g in gpu)
    assert worst < 1e-5
    assert max(abs(a - b) for c, g in zip(cpu, gpu) for a, b in zip(c.logp_sparse, g.logp_sparse)) < 1e-4


@pytest.mark.parametrize("policy,variant", [("rkv", "paper"), ("rkv", "reference"), ("snapkv", "paper"),
                                            ("streaming", "paper")])
def test_compressed_rollouts_are_the_same_on_cuda_and_cpu(policy, variant):
    """float64 on both devices, so that the eviction scores agree far below any gap between them: the same
    positions are kept, and so the same tokens are drawn. Pooling kernel 1: max-pooling repeats a score over
    neighbours, and topk chooses among equal scores differently on CPU and CUDA (docs/gpu.md)."""
    kv = KVPolicyConfig(algorithm=policy, budget=16, window=4, divide_length=8, kernel=1, sinks=2, variant=variant)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=5)
    runs = {}
    for device in ("cpu", "cuda"):
        model = tiny_model("llama", dtype=torch.float64).to(device)
        engine = NativeEngine(model, num_slots=2048, eos_token_ids=[], kv=kv)
        runs[device] = engine.generate(requests(params))
        assert engine.stats().compressions > 0
    for c, g in zip(runs["cpu"], runs["cuda"]):
        assert g.token_ids == c.token_ids
        assert g.kv.compressed_at == c.kv.compressed_at and g.kv.retained_tokens == c.kv.retained_tokens
        assert max(abs(a - b) for a, b in zip(c.logp_sparse, g.logp_sparse)) < 1e-5  # logp_sparse is kept in fp32


def test_decode_cache_on_equals_off_on_cuda():
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=1)
    out = {mode: NativeEngine(tiny_model("qwen2").to(CUDA), num_slots=1024, eos_token_ids=[], decode_cache=mode)
           .generate(requests(params)) for mode in ("on", "off")}
    for a, b in zip(out["on"], out["off"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logp_sparse, b.logp_sparse)) < 1e-5


def test_draw_and_sampling_transform_never_synchronize_on_cuda():
    """CUDA's own sync detector (not a counter of ours): any blocking device-to-host transfer raises."""
    logits = torch.randn(8, 3000, device=CUDA)
    rows = [(i, 1.0 if i % 3 else 0.0, 0.9 if i % 2 else 1.0, 5 if i == 4 else 0) for i in range(8)]
    s = RowSettings.from_rows(rows, CUDA)
    positions = torch.arange(8, device=CUDA) + 40
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = sample(logits, s, positions)
        processed_logprobs(logits, 0.7, 0.95, 20)
        processed_logprobs(logits, s.temperature, s.top_p, s.top_k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (8,) and tokens.device.type == "cuda"
    with pytest.raises(RuntimeError):  # the detector is live: a real sync is caught
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens.tolist()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("scheme", ["int8", "w8a8", "fp8"])
def test_quantized_rollouts_track_the_float_model_on_cuda(scheme):
    ref = tiny_model("qwen2").to(CUDA)
    engine = NativeEngine(tiny_model("qwen2").to(CUDA), num_slots=1024, eos_token_ids=[], quantization=scheme)
    gens = engine.generate(requests(SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=3)))
    assert all(len(g.token_ids) == 16 for g in gens)
    d = torch.cat([dense_logprobs(ref, g, 1.0) - torch.tensor(g.logp_sparse) for g in gens]).abs()
    assert torch.isfinite(d).all()
    assert 1e-6 < d.mean() < 0.1, f"{scheme}: mean |dlogp| {d.mean():.3g}"  # a real, small mismatch
    assert engine.stats().extra["rollout/weight_bytes_saved"] > 0


def test_sleep_returns_the_kv_pool_and_weights_to_the_device():
    model = tiny_model("llama", layers=4).to(CUDA)
    engine = NativeEngine(model, num_slots=1 << 16, eos_token_ids=[], release_weights=True)
    engine.generate(requests(SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)))
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    # The pool: 4 layers x K and V x 65536 slots x 2 KV heads x 16 dims x 4 bytes = 64 MiB.
    pool = 4 * 2 * (1 << 16) * 2 * 16 * 4
    assert awake - asleep >= pool, (awake, asleep)
    engine.update_weights(tiny_model("llama", layers=4).to(CUDA).state_dict().items())  # as the trainer pushes
    engine.wake()
    again = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=8)))
    assert all(len(g.token_ids) == 8 for g in again)


# ------------------------------------------------------------------ the trainer on CUDA

def run_trainer(ckpt, tmp_path, name, extra):
    """2 steps of the GRPO trainer through torchrun on CUDA; its metrics and its log."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(3, 4), (2, 3), (4, 4), (5, 1)]]  # no answer "2": FAILING_ENV never fails here
    data = write_data(tmp_path / "train.jsonl", rows)
    env = tmp_path / "env.py"
    env.write_text(FAILING_ENV)
    out = tmp_path / name
    args = {"model.path": ckpt, "data.train_path": data, "env.path": env, "trainer.output_dir": out,
            "trainer.total_steps": 2, "trainer.prompts_per_step": 4, "rollout.n": 4, "rollout.max_new_tokens": 24,
            "actor.lr": 1e-3, "algo.entropy_coef": 0.01, "parallel.device": "cuda", **extra}
    res = trainer([f"{k}={v}" for k, v in args.items()], torchrun=True)
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    return metrics, res.stdout + res.stderr


def test_trainer_dense_fp32_on_cuda_with_nccl(tiny_checkpoint, tmp_path):
    metrics, log = run_trainer(tiny_checkpoint, tmp_path, "dense", {
        "+preset": "dense", "model.compute_dtype": "float32", "rollout.dtype": "float32",
        "algo.correction.enable": "true"})
    assert "processes: 1 on cuda (nccl)" in log, log[-2000:]
    for m in metrics:
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/abs_max"] < 1e-3, m
        assert m["actor/grad_norm"] > 0
        assert m["mem/peak_gb"] > 0
    assert (tmp_path / "dense" / "hf" / "config.json").exists()


@pytest.mark.parametrize("preset", ["dense", "sparse_rl"])
def test_trainer_bf16_on_cuda(tiny_checkpoint, tmp_path, preset):
    metrics, _ = run_trainer(tiny_checkpoint, tmp_path, preset, {
        "+preset": preset, "rollout.kv.budget": 16, "rollout.kv.divide_length": 8, "rollout.kv.window": 4})
    for m in metrics:
        assert all(v == v for v in m.values() if isinstance(v, float)), "NaN in the metrics"
        assert m["actor/grad_norm"] > 0
        # bf16 sampler against the bf16 actor: a small, nonzero mismatch; compression adds to it
        assert abs(m["mismatch/kl"]) < 0.1, m["mismatch/kl"]
    if preset == "sparse_rl":
        assert metrics[-1]["kv/compressions"] > 0
