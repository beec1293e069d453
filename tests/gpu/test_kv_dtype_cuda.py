"""`rollout.kv_dtype` int8 / fp8 pools on CUDA: captured decode turns off, rollouts (dense and R-KV) finish, and dense
ones stay close to a recompute without a cache, as on the CPU (tests/unit/test_kv_dtype.py). Skipped where no CUDA
device is visible."""
import pytest
import torch

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kv import KVPolicyConfig
from tests.conftest import tiny_model
from tests.unit.test_native_engine import PROMPTS, dense_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("kv", [None, KVPolicyConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel=3)])
def test_quantized_pools_on_cuda(kv_dtype, kv):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = NativeEngine(tiny_model("llama").to(CUDA), num_slots=2048, eos_token_ids=[], kv=kv, kv_dtype=kv_dtype)
    assert engine.runner.graphs is None  # cuda_graphs=auto: off for a quantized pool (one log line)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, n=2, seed=3)
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(PROMPTS)])
    assert all(len(g.token_ids) == 32 for g in gens) and engine.pool.num_used == 0
    if kv is None:
        ref = tiny_model("llama").to(CUDA)
        diff = torch.cat([torch.tensor(g.logp_sparse) - dense_logprobs(ref, g, 1.0) for g in gens]).abs()
        assert 1e-6 < diff.mean() < (2e-3 if kv_dtype == "int8" else 8e-3)
