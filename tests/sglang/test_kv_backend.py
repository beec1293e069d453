"""The sparserl_kv attention backend in a real SGLang engine (tiny random fp32 Llama, CPU, torch_native base).

- a budget the sequences never reach, for each policy (rkv, snapkv, streaming): the same tokens and log-probs as
  the dense engine, no compaction;
- R-KV budget 32 / divide_length 16 / window 8 / share=head: the same tokens as the native engine, and the same
  kept logical positions at every trigger, for 80 new tokens;
- a pool that holds 2 sequences densely runs 8 compressed ones at once, every slot free again after each
  generate (the engine raises otherwise; SGLang's own per-step conservation check is on in these hosts).
Four engines are started for this file (one per policy config), side by side when the module starts; each test
reuses them, and each is stopped when its tests are done.
"""
import dataclasses
import os

import pytest

from sparserl.kv import KVPolicyConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.sglang.conftest import build_tiny, host_options
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON, EngineHost

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)

RKV = KVPolicyConfig(algorithm="rkv", budget=32, divide_length=16, window=8, share="head")
PROMPT_LEN, NEW = 12, 80
LONG = 200  # the pool test's new tokens: a dense sequence then holds 212 entries, a compressed one at most 48
POOL = 2 * (PROMPT_LEN + LONG)  # room for 2 sequences at their dense length
PROMPTS = [[(7 * i + 3 * j) % 900 + 20 for j in range(PROMPT_LEN)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


def requests(params, prompts):
    return [GenerationRequest(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]


@pytest.fixture(scope="module", autouse=True)
def _strict_slot_checks():
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"  # SGLang asserts slot conservation every step
    yield
    os.environ.pop("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", None)


def _host(tiny_dirs, **options):
    return EngineHost(tiny_dirs["llama"], host_options(**options), start_timeout=1200)


WIDE = ("rkv", "snapkv", "streaming")


@pytest.fixture(scope="module")
def file_hosts(tiny_dirs):
    """This file's four engines, started side by side: each policy with a budget no sequence here reaches over a
    roomy pool (WIDE), and "pool": R-KV budget 32 over a pool that holds 2 sequences at their dense length,
    reporting kept positions."""
    started = {name: _host(tiny_dirs, kv=dataclasses.asdict(KVPolicyConfig(algorithm=name, budget=512,
                                                                             divide_length=16, window=8)))
               for name in WIDE}
    started["pool"] = _host(tiny_dirs, max_total_tokens=POOL, kv=dataclasses.asdict(RKV), kv_trace=True)
    yield started
    for host in started.values():
        host.close()


@pytest.fixture(scope="module", params=WIDE)
def wide_host(request, file_hosts):
    """The policy with a budget no sequence here reaches, over a roomy pool; stopped when its tests are done."""
    host = file_hosts[request.param]
    yield host
    host.close()


@pytest.fixture(scope="module")
def rkv_host(file_hosts):
    """R-KV budget 32 over a pool that holds 2 sequences at their dense length, reporting kept positions."""
    return file_hosts["pool"]


@pytest.fixture(scope="module")
def dense_runs(hosts):
    """The dense engine's generations per sampling params, made once for every policy: a repeat would prefill from
    that engine's radix cache, which rounds differently from a full prefill."""
    runs = {}

    def get(params, reqs):
        if params not in runs:
            runs[params] = hosts("llama").generate(reqs)
        return runs[params]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, max_new_tokens=48, n=2, seed=3, ignore_eos=True)])
def test_budget_above_the_sequence_changes_nothing(params, wide_host, dense_runs):
    wide = wide_host
    reqs = requests(params, PROMPTS[:3])
    dense, kept = dense_runs(params, reqs), wide.generate(reqs)
    for d, k in zip(dense, kept):
        assert k.token_ids == d.token_ids
        if params.temperature == 0:
            assert k.logp_sparse == d.logp_sparse  # bitwise: the backend only captured queries
        else:  # the dense engine's samples share one prefill through the radix cache; here each prefills
            assert max(abs(a - b) for a, b in zip(k.logp_sparse, d.logp_sparse)) < 1e-5
        assert k.kv.compressions == 0 and k.kv.retained_tokens == k.kv.total_tokens == k.kv.peak_slots
    stats = wide.stats()
    assert stats.compressions == 0 and stats.extra["kv/pool_free_after"] == stats.extra["kv/pool_size"]


def test_same_tokens_and_kept_positions_as_the_native_engine(rkv_host, tokenizer):
    rkv = rkv_host
    prompts = PROMPTS[:2]
    gens = rkv.generate(requests(GREEDY, prompts))
    trace = rkv.kv_trace()

    native = NativeEngine(build_tiny("llama", tokenizer), tokenizer, num_slots=4096, kv=RKV)
    kept_native: dict = {}
    compress_all = native.compression.compress_all  # every compaction of a step, batched

    def recording(due, scheduler):
        compress_all(due, scheduler)
        for seq, st in due:
            kept_native.setdefault(seq.request_index, []).append(st.kept_positions.tolist())

    native.compression.compress_all = recording
    ref = native.generate(requests(GREEDY, prompts))
    for i, (g, n) in enumerate(zip(gens, ref)):
        assert len(g.token_ids) == NEW and g.token_ids == n.token_ids
        assert max(abs(a - b) for a, b in zip(g.logp_sparse, n.logp_sparse)) < 1e-4
        assert g.kv.compressed_at == n.kv.compressed_at and g.kv.compressions >= 4
        assert trace[(f"r{i}", 0)] == kept_native[i]  # (layers, H_kv, 32) logical positions at every trigger
        assert (g.kv.peak_slots, g.kv.retained_tokens) == (n.kv.peak_slots, n.kv.retained_tokens)
    # Heads keep different tokens (share=head): the check above compares per-head sets.
    assert any(layer[0] != layer[1] for t in trace.values() for kept in t for layer in kept)


@pytest.mark.slow
def test_compressed_requests_outnumber_the_dense_pool_and_every_slot_returns(rkv_host):
    rkv = rkv_host
    for round_ in range(2):
        rkv.reset_stats()
        gens = rkv.generate(requests(dataclasses.replace(GREEDY, max_new_tokens=LONG), PROMPTS))
        stats = rkv.stats()
        assert len(gens) == 8 and all(len(g.token_ids) == LONG for g in gens)
        assert stats.extra["kv/pool_size"] == POOL
        bound = RKV.budget + RKV.divide_length
        assert max(g.kv.peak_slots for g in gens) <= bound
        assert stats.peak_running >= 6, stats
        assert stats.peak_slots <= stats.pool_slots
        assert stats.extra["kv/pool_free_after"] == stats.extra["kv/pool_size"]  # every slot back in the allocator
        assert stats.compressions == sum(g.kv.compressions for g in gens) > 0
