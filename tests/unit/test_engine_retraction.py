"""Optimistic admission in the native engine on a tiny random model (fp32): sequences retracted when the pool runs
out come back with the tokens and log-probs a pool that never binds gives, dense and compressed (a compressed one
rebuilt to the same keep-sets); the refusals; sessions under retraction."""
import pytest
import torch

from sparserl.kv import KVPolicyConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7], [2, 8, 4, 4], [9, 3, 6, 1, 2], [4, 4, 10], [6, 11, 12, 13], [7, 2]]
RKV = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=6, kernel=3)
# The engine is not batch-invariant to the last bit: the same sequences in other batches (max_num_seqs=1 against all
# at once) move log-probs by ~5e-7 here (one or two float32 ulps at |logp| ~ 5), and a retraction changes the
# batches, so log-probs are compared to 1e-5, as a dense generation of a compressing engine is.
LOGP_TOL = 1e-5


def generate(num_slots, kv=None, max_new=24, n=2, admission="optimistic", eos=()):
    engine = NativeEngine(tiny_model("llama"), num_slots=num_slots, eos_token_ids=list(eos), kv=kv, admission=admission)
    engine.trace = []
    kept = {}  # (request, sample) -> [(compaction index, kept positions)]
    if engine.compression is not None:  # watch every compaction, the replayed ones too
        compress = engine.compression.compress_all

        def watch(due, scheduler, replay=False):
            compress(due, scheduler, replay)
            for seq, st in due:
                index = len(seq.compressed_at) - 1 - (len(seq.replay_ends) if replay else 0)
                kept.setdefault((seq.request_index, seq.sample_index), []).append((index, replay, st.kept_positions.clone()))

        engine.compression.compress_all = watch
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n, seed=3)
    gens = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(PROMPTS)])
    return engine, gens, kept


def assert_same(gens, ref):
    for g, r in zip(gens, ref):
        assert g.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(g.logp_sparse, r.logp_sparse)) < LOGP_TOL


def test_retracted_dense_sequences_redraw_the_same_tokens():
    _, ref, _ = generate(4096, max_new=16)
    engine, gens, _ = generate(40, max_new=16)  # 12 sequences of up to 20 entries: a few at a time
    st = engine.stats()
    assert st.retractions > 0 and st.recomputed_tokens > 0
    assert st.retractions == sum(g.kv.retractions for g in gens)
    assert_same(gens, ref)
    assert max(t.pool_high_water for t in engine.trace) <= 40 and engine.pool.num_used == 0
    assert not any(set(t.retracted) & set(t.admitted) for t in engine.trace)  # a step that retracts admits nothing


def test_retracted_compressed_sequences_are_rebuilt_to_the_same_keep_sets():
    big, ref, ref_kept = generate(4096, RKV)
    engine, gens, kept = generate(40, RKV)
    assert engine.stats().retractions > 0
    assert_same(gens, ref)
    assert [g.kv.compressed_at for g in gens] == [g.kv.compressed_at for g in ref]
    assert engine.stats().compressions == big.stats().compressions  # replays are not counted again
    replays = 0
    for key, events in kept.items():
        first = [positions for _, _, positions in ref_kept[key]]
        for index, replay, positions in events:
            replays += replay
            assert torch.equal(positions, first[index]), (key, index, replay)
    assert replays > 0, "some retracted sequence must have been compacted again on its way back"


def test_reserve_and_optimistic_schedules_match_while_the_pool_holds_every_worst_case():
    reserve, a, _ = generate(12 * 28, admission="reserve")
    optimistic, b, _ = generate(12 * 28)
    assert [(t.admitted, t.decoding) for t in reserve.trace] == [(t.admitted, t.decoding) for t in optimistic.trace]
    for g, h in zip(a, b):
        assert g.token_ids == h.token_ids and g.logp_sparse == h.logp_sparse


def test_optimistic_runs_more_at_once_when_responses_end_early():
    # Token 3 ends a response (the tiny model draws it now and then): worst cases reserved for nothing.
    reserve, a, _ = generate(40, max_new=30, n=1, admission="reserve", eos=(3, 17))
    optimistic, b, _ = generate(40, max_new=30, n=1, eos=(3, 17))
    assert optimistic.stats().peak_running > reserve.stats().peak_running == 1
    assert_same(b, a)


def test_a_sequence_larger_than_the_pool_is_refused_before_any_work():
    engine = NativeEngine(tiny_model("llama"), num_slots=30, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=20)
    with pytest.raises(ValueError, match=r"'big'.*needs up to 34 KV slots, but the pool has 30; raise rollout.kv_memory"):
        engine.generate([GenerationRequest([1, 2], params, "small"), GenerationRequest(list(range(1, 16)), params, "big")])
    assert engine.pool.num_free == 30 and engine.stats().new_tokens == 0
    assert len(engine.generate([GenerationRequest([1, 2], params, "small")])[0].token_ids) == 20


def test_sessions_compose_with_retraction():
    obs = [20, 21, 22]

    def episodes(engine, sessions, turns=3):
        history = [list(p) for p in PROMPTS[:4]]
        out = []
        for t in range(turns):
            keep = sessions and t < turns - 1
            params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
            gens = engine.generate([GenerationRequest(h, params, i, session_id=f"ep{i}" if sessions else None,
                                                      keep_session=keep) for i, h in enumerate(history)])
            out.append(gens)
            history = [h + g.token_ids + obs for h, g in zip(history, gens)]
        engine.end_sessions()
        return out

    ref = episodes(NativeEngine(tiny_model("llama"), num_slots=4096, eos_token_ids=[]), sessions=False)
    tight = NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[])
    tight.trace = []
    got = episodes(tight, sessions=True)
    for turn, want in zip(got, ref):
        for g, r in zip(turn, want):  # a continued turn against a re-prefill: to 1e-5, as in test_engine_sessions
            assert g.token_ids == r.token_ids
            assert max(abs(a - b) for a, b in zip(g.logp_sparse, r.logp_sparse)) < 1e-5
    st = tight.stats()
    assert st.retractions > 0 and st.sessions_continued > 0
    assert max(t.pool_high_water for t in tight.trace) <= 64 and tight.pool.num_used == 0

    # Compressed: a sequence that continues a held session is never retracted (re-prefill would not rebuild its
    # earlier turns' cache); the others still are, and the pool's count stays exact.
    comp = NativeEngine(tiny_model("llama"), num_slots=48, eos_token_ids=[], kv=RKV)
    for turn in episodes(comp, sessions=True):
        for g in turn:
            assert not (g.kv.reused_tokens and g.kv.retractions)
            assert len(g.token_ids) == 10
    assert comp.stats().retractions > 0 and comp.pool.num_used == 0
