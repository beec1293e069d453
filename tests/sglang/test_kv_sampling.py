"""Sampled rollouts through the sparserl_kv backend (tiny random fp32 Llama, CPU, torch_native base, R-KV).

- every token's noise is keyed by its logical position (prompt length - 1 + its index), never by the KV cache's
  physical length, which falls back after each compaction: all keys of a sequence are distinct;
- over 128 compressed samples the share of 4-grams repeated inside a sequence is within noise of the dense
  rollout's share (noise keyed by physical positions comes back every divide_length tokens; on this near-flat
  random model that copies whole stretches of a sequence);
- the compression bookkeeping makes no device-to-host sync (at most one per decode step is the bar);
- the compactor's query ring is freed when the engine sleeps, and allocated again after wake.
"""
import dataclasses
from pathlib import Path

import pytest

from sparserl.kv import KVPolicyConfig
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.sglang.conftest import host_options, register_early, take_early
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON, EngineHost

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)

RKV = KVPolicyConfig(algorithm="rkv", budget=32, divide_length=16, window=8, share="head")
PROMPT_LEN, NEW, PROMPTS, N = 12, 80, 16, 8  # 128 samples, each compacted 4 times
SAMPLED = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=NEW, n=N, seed=5, ignore_eos=True)


def requests():
    prompts = [[(11 * i + 5 * j) % 900 + 20 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]
    return [GenerationRequest(p, SAMPLED, request_id=f"q{i}") for i, p in enumerate(prompts)]


def repeated_4gram_share(tokens: list[int]) -> float:
    """Share of a sequence's 4-grams that already occurred earlier in it."""
    seen, repeats = set(), 0
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def _sampled_host(tiny_dirs) -> EngineHost:
    return EngineHost(tiny_dirs["llama"], host_options(kv=dataclasses.asdict(RKV), kv_trace=True, kv_count_syncs=True,
                                                     release_weights=False),
                      start_timeout=1200)


register_early(Path(__file__).name, _sampled_host)  # starts beside the session's hosts


@pytest.fixture(scope="module")
def sampled_host(tiny_dirs, hosts):
    host = take_early(Path(__file__).name, tiny_dirs)
    yield host
    host.close()


@pytest.fixture(scope="module")
def rollouts(sampled_host, hosts):
    sampled_host.reset_stats()
    sparse = sampled_host.generate(requests())
    return sparse, sampled_host.draw_trace(), sampled_host.stats(), hosts("llama").generate(requests())


@pytest.mark.slow
def test_every_token_draws_with_the_key_of_its_logical_position(rollouts):
    sparse, trace, _, _ = rollouts
    assert len(sparse) == PROMPTS * N
    for g in sparse:
        assert len(g.token_ids) == NEW and g.kv.compressions >= 3
        keyed = trace[(g.request_id, g.sample_index)]
        assert keyed == [PROMPT_LEN - 1 + t for t in range(NEW)]  # logical positions, all distinct
        assert g.kv.retained_tokens < PROMPT_LEN + NEW - 1  # the physical length fell back: compaction ran


def test_compressed_samples_repeat_no_more_than_dense_ones(rollouts):
    sparse, _, _, dense = rollouts
    share = [sum(repeated_4gram_share(g.token_ids) for g in gens) / len(gens) for gens in (sparse, dense)]
    print(f"repeated 4-gram share: compressed {share[0]:.4f}, dense {share[1]:.4f} over {len(sparse)} samples each")
    # Independent draws from a near-flat distribution over 49k tokens almost never repeat a 4-gram.
    assert share[1] < 0.01
    assert share[0] < share[1] + 0.01


def test_bookkeeping_syncs_at_most_once_per_decode_step(rollouts):
    _, _, stats, _ = rollouts
    forwards = stats.extra["kv/decode_forwards"]
    assert forwards >= NEW - 1  # every decode forward went through the counted bookkeeping
    assert stats.compressions >= 3 * PROMPTS * N
    assert stats.extra["kv/host_syncs"] == 0, stats.extra


@pytest.mark.slow
def test_query_ring_is_freed_on_sleep(sampled_host, rollouts):
    _, _, stats, _ = rollouts
    assert stats.extra["kv/query_buffer_mb"] > 0
    sampled_host.sleep()
    assert sampled_host.kv_counters().query_buffer_bytes == 0
    sampled_host.wake()
    sampled_host.reset_stats()
    again = sampled_host.generate(requests()[:2])
    assert all(len(g.token_ids) == NEW for g in again)
    assert sampled_host.stats().extra["kv/query_buffer_mb"] > 0
