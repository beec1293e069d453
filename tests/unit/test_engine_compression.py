"""KV compression inside the native engine: exactness without pressure, slot bounds, memory really freed."""
import random

import pytest

from sparserl.kv import KVPolicyConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

POLICIES = ["rkv", "snapkv", "streaming"]


def run(kv, prompts, max_new, num_slots=4096, seed=0, trace=False, n=1, model_seed=0, admission="optimistic"):
    engine = NativeEngine(tiny_model("llama", seed=model_seed), num_slots=num_slots, eos_token_ids=[], kv=kv,
                          admission=admission)
    if trace:
        engine.trace = []
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed, n=n)
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    return engine, gens


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_above_sequence_length_is_exactly_dense(policy):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9] * 11]
    _, dense = run(None, prompts, 30)
    kv = KVPolicyConfig(algorithm=policy, budget=64, window=4, divide_length=8, kernel=3, sinks=2)
    engine, sparse = run(kv, prompts, 30)
    assert engine.stats().compressions == 0
    for d, s in zip(dense, sparse):
        assert d.token_ids == s.token_ids
        assert max(abs(a - b) for a, b in zip(d.logp_sparse, s.logp_sparse)) < 1e-6


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("share", ["head", "layer", "all"])
def test_compression_frees_slots_and_keeps_generating(policy, share):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5]]
    kv = KVPolicyConfig(algorithm=policy, budget=16, window=4, divide_length=8, kernel=3, sinks=2, share=share)
    engine, gens = run(kv, prompts, 60, trace=True, n=2)
    assert [len(g.token_ids) for g in gens] == [60] * 4
    assert all(g.kv.compressions >= 5 for g in gens)
    assert all(g.kv.peak_slots <= 16 + 8 for g in gens)
    assert all(16 <= g.kv.retained_tokens <= 24 for g in gens)
    assert engine.trace[-1].slots_used == 0
    dense_peak = max(len(p) for p in prompts) + 60
    assert max(t.pool_high_water for t in engine.trace) <= 4 * 24 < 4 * dense_peak


def test_compressed_requests_run_more_at_once_in_a_fixed_pool():
    prompts = [[i + 1, 2, 3, 4] for i in range(8)]
    pool = 2 * (4 + 64)  # room for two dense requests at their worst case
    dense_engine, _ = run(None, prompts, 64, num_slots=pool, admission="reserve")
    kv = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=8, kernel=3)
    sparse_engine, gens = run(kv, prompts, 64, num_slots=pool, admission="reserve")
    assert dense_engine.stats().peak_running == 2
    assert sparse_engine.stats().peak_running >= 6
    assert all(len(g.token_ids) == 64 for g in gens)


def test_random_schedules_respect_the_slot_bound():
    rng = random.Random(0)
    for trial in range(6):
        budget = rng.choice([8, 12, 20])
        divide = rng.choice([4, 8])
        kv = KVPolicyConfig(algorithm=rng.choice(POLICIES), budget=budget, window=4, divide_length=divide, kernel=3, sinks=2)
        prompts = [[rng.randrange(1, 120) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(2, 6))]
        max_new = rng.randrange(5, 50)
        bound = [max(len(p), budget) + divide for p in prompts]
        reserve = [min(len(p) + max_new - 1, b) for p, b in zip(prompts, bound)]
        pool = max(reserve) + rng.randrange(0, 40)
        engine, gens = run(kv, prompts, max_new, num_slots=pool, seed=trial, trace=True)
        for g, b in zip(gens, bound):
            assert g.kv.peak_slots <= b, (trial, g.kv, b)
        assert max(t.pool_high_water for t in engine.trace) <= pool
        assert engine.trace[-1].slots_used == 0
        assert [len(g.token_ids) for g in gens] == [max_new] * len(prompts)


def test_newline_trigger_needs_tokenizer():
    with pytest.raises(ValueError, match="newline"):
        NativeEngine(tiny_model("llama"), num_slots=64, kv=KVPolicyConfig(algorithm="rkv", budget=16, divide_method="newline"))
