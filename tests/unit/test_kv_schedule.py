"""Compression schedule bookkeeping: when a request compresses, to what length, and the slot bound.

Left out on purpose: tensors and engines; the property test is a seeded random loop (no extra dependency).
"""
import random

import pytest

from sparserl.kv import CompressionSchedule, KVPolicyConfig, is_newline_token


def simulate(cfg, prompt_len, max_new_tokens, newline_at=frozenset()):
    """Decode `max_new_tokens` steps; returns (steps that compressed, length held after each step's append)."""
    sched = CompressionSchedule(cfg, prompt_len)
    cached, fired, held = prompt_len, [], []
    for step in range(1, max_new_tokens + 1):
        cached += 1
        held.append(cached)
        if sched.on_token(cached, step in newline_at):
            assert sched.target_len() < cached, "a compression must free something"
            fired.append(step)
            cached = sched.target_len()
    return fired, held


def test_slot_bound_holds_for_random_requests():
    rng = random.Random(0)
    for _ in range(400):
        window = rng.randint(1, 8)
        cfg = KVPolicyConfig(
            algorithm=rng.choice(["rkv", "snapkv", "streaming"]),
            window=window,
            budget=rng.randint(window + 1, 64),
            sinks=0,
            divide_method=rng.choice(["step_length", "newline"]),
            divide_length=rng.randint(1, 40),
            compress_prompt=rng.random() < 0.5,
        )
        prompt_len, max_new = rng.randint(0, 150), rng.randint(0, 300)
        newline_p = rng.random()
        newlines = frozenset(s for s in range(1, max_new + 1) if rng.random() < newline_p)
        bound = CompressionSchedule.max_slots(cfg, prompt_len, max_new)
        floor = CompressionSchedule(cfg, prompt_len).floor
        fired, held = simulate(cfg, prompt_len, max_new, newlines)
        assert prompt_len <= bound and all(h <= bound for h in held), (cfg, prompt_len, max_new)
        if fired:
            assert all(h <= floor + cfg.divide_length for h in held[fired[0]:]), (cfg, prompt_len, max_new)
        long_enough = max_new >= 2 * (floor + cfg.divide_length)
        if cfg.divide_method == "step_length" and not cfg.compress_prompt and long_enough:
            assert max(held) == bound, "the bound is tight, so admission reserves no more than needed"


def test_step_length_fires_every_divide_length_steps_once_over_the_floor():
    cfg = KVPolicyConfig(algorithm="rkv", budget=20, window=4, divide_length=5)
    fired, held = simulate(cfg, prompt_len=10, max_new_tokens=60)
    # The cache passes the floor (20) at step 11; from then on every 5 steps, back to 20 each time.
    assert fired == list(range(11, 61, 5))
    assert max(held) == 25 == CompressionSchedule.max_slots(cfg, 10, 60)


def test_step_length_waits_for_divide_length_after_prefill():
    cfg = KVPolicyConfig(algorithm="rkv", budget=20, window=4, divide_length=8)
    fired, _ = simulate(cfg, prompt_len=18, max_new_tokens=30)
    assert fired == [8, 16, 24]  # over the floor at step 3, but only 8 steps after prefill


def test_newline_fires_on_newlines_over_the_floor_and_at_the_cap():
    cfg = KVPolicyConfig(algorithm="rkv", budget=20, window=4, divide_method="newline", divide_length=50)
    fired, held = simulate(cfg, prompt_len=10, max_new_tokens=80, newline_at=frozenset({3, 15, 16, 17}))
    # Step 3 is under the floor; 15, 16, 17 are over it; then no newline until the cap 20 + 50 at step 67.
    assert fired == [15, 16, 17, 67]
    assert max(held) == 70


def test_prompt_is_not_compressed_below_its_length_unless_allowed():
    kept = KVPolicyConfig(algorithm="snapkv", budget=20, window=4, divide_length=8)
    sched = CompressionSchedule(kept, prompt_len=100)
    assert sched.target_len() == 100
    fired, _ = simulate(kept, prompt_len=100, max_new_tokens=20)
    assert fired == [8, 16]  # first trigger once over the prompt, and it keeps 100

    allowed = KVPolicyConfig(algorithm="snapkv", budget=20, window=4, divide_length=8, compress_prompt=True)
    assert CompressionSchedule(allowed, prompt_len=100).target_len() == 20
    fired, held = simulate(allowed, prompt_len=100, max_new_tokens=20)
    assert fired[0] == 1  # a prompt already over the cap compresses with the first decoded token
    assert max(held) == 101 == CompressionSchedule.max_slots(allowed, 100, 20)
    assert max(held[1:]) <= 28


def test_short_prompt_keeps_budget_and_none_never_compresses():
    assert CompressionSchedule(KVPolicyConfig(algorithm="rkv", budget=20), prompt_len=5).target_len() == 20
    dense = KVPolicyConfig()
    fired, held = simulate(dense, prompt_len=600, max_new_tokens=300, newline_at=frozenset(range(300)))
    assert fired == [] and max(held) == 900 == CompressionSchedule.max_slots(dense, 600, 300)


def test_is_newline_token():
    assert is_newline_token("\n") and is_newline_token(".\n\n") and is_newline_token(")\n")
    assert not is_newline_token("a") and not is_newline_token("\n ") and not is_newline_token("")


def test_negative_prompt_len_rejected():
    with pytest.raises(ValueError, match="prompt_len"):
        CompressionSchedule(KVPolicyConfig(algorithm="rkv"), prompt_len=-1)
