"""`rollout.decode_cache`: the engine's contiguous per-sequence K/V copies change nothing but speed and memory.

Every scenario runs twice on the same tiny fp32 model, cache on and off, and must give the same tokens and
log-probs: sequences that finish at different steps (idle rows, rows handed to newly admitted sequences while
others decode), a pool too small for all requests at once, forked siblings, R-KV compaction per KV head (rows
re-copied after every compression) and kept sessions over several turns.
"""
import pytest
import torch

from sparserl.kv import KVPolicyConfig
from sparserl.engines.native.decode_cache import resolve_decode_cache
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6], [9, 8, 7, 6, 5, 4, 3],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def both(make_engine, run):
    outs = []
    for setting in ("on", "off"):
        engine = make_engine(setting)
        assert (engine.runner.table.cache is not None) == (setting == "on")
        outs.append(run(engine))
    return outs


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logp_sparse), torch.tensor(y.logp_sparse), rtol=0, atol=2e-5)


def test_uneven_finishes_and_row_reuse():
    # EOS ends sequences at different steps; 70 slots hold only some requests, so later ones take freed rows.
    eos = [7, 9, 11]
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=16 + 3 * i, seed=i, n=2), i)
            for i, p in enumerate(PROMPTS)]
    on, off = both(lambda s: NativeEngine(tiny_model("llama"), num_slots=70, eos_token_ids=eos, decode_cache=s),
                   lambda e: e.generate(reqs))
    assert_same(on, off)
    assert len({len(g.token_ids) for g in on}) > 3, "the sequences should end at different steps"


def test_compaction_per_kv_head_and_forks():
    kv = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=8, kernel=3, share="head")
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=32, seed=i, n=3), i)
            for i, p in enumerate(PROMPTS[:3])]

    def make(setting):
        return NativeEngine(tiny_model("qwen2"), num_slots=2048, eos_token_ids=[], kv=kv, decode_cache=setting)

    on, off = both(make, lambda e: e.generate(reqs))
    assert_same(on, off)
    assert all(g.kv.compressions >= 3 for g in on)


def test_kept_sessions_over_turns():
    def run(engine):
        out, history = [], [list(p) for p in PROMPTS[:3]]
        for turn in range(3):
            reqs = [GenerationRequest(h, SamplingParams(temperature=1.0, max_new_tokens=6, seed=10 * turn + i), i,
                                      session_id=f"ep{i}", keep_session=turn < 2) for i, h in enumerate(history)]
            gens = engine.generate(reqs)
            out += gens
            history = [h + g.token_ids + [40 + turn, 41] for h, g in zip(history, gens)]
        return out

    on, off = both(lambda s: NativeEngine(tiny_model("llama"), num_slots=1024, eos_token_ids=[], decode_cache=s), run)
    assert_same(on, off)


def test_setting_resolution():
    assert resolve_decode_cache("auto", torch.device("cpu")) is True
    assert resolve_decode_cache("auto", torch.device("cuda")) is False
    assert resolve_decode_cache("on", torch.device("cuda")) is True and resolve_decode_cache("off", torch.device("cpu")) is False
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_decode_cache("yes", torch.device("cpu"))


def test_growth_sizes_for_what_the_sequences_can_reach():
    from sparserl.engines.native.decode_cache import DecodeCache

    cache = DecodeCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    cache.reserve(5, 100, reach=230)  # prompt + max_new_tokens within 2x of the need: one allocation for the rollout
    assert (cache.k[0].shape[0], cache.k[0].shape[2]) == (8, 256)
    cache.reserve(5, 256, reach=230)
    assert cache.k[0].shape[2] == 256

    cache = DecodeCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    cache.reserve(3, 100, reach=5000)  # a long budget: what is needed now, then doubling up to the reach
    assert cache.k[0].shape[2] == 128
    cache.k[1][:3, :, :100] = torch.arange(600, dtype=torch.float32).view(3, 1, 100, 2)
    cache.reserve(3, 129, reach=5000)
    assert cache.k[1].shape[2] == 256
    assert torch.equal(cache.k[1][:3, :, :100], torch.arange(600, dtype=torch.float32).view(3, 1, 100, 2))
    assert not cache.k[1][:, :, 100:].any() and not cache.v[0].any()  # new entries are zeros (read, then masked)
    cache.reserve(3, 300, reach=4700)
    assert cache.k[0].shape[2] == 512
    cache.reserve(3, 4650, reach=4700)  # doubling stops at the reach
    assert cache.k[0].shape[2] == 4736
