"""Partial rollouts in the native engine on a tiny random model (fp32): a generate call stopped by a `Cutoff` and its
samples resumed (`GenerationRequest.resume`) in later calls, weights unchanged, give the tokens, log-probs and
compaction points of one uninterrupted call, dense and compressed; the cutoff's rules; bad resumes refused."""
import pytest

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import Cutoff, GenerationRequest, Resume, SamplingParams
from sparserl.kv import KVPolicyConfig
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7], [2, 8, 4, 4], [9, 3, 6, 1, 2], [4, 4, 10]]
RKV = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=6, kernel=3)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=3)
# A resumed sequence's cache is re-prefilled in other batches than the one that drew it: its later log-probs move by
# float32 ulps (tests/unit/test_engine_retraction.py), its carried ones are returned as given (compared exactly).
LOGP_TOL = 1e-5


def engine(kv=None, eos=(3,)):
    return NativeEngine(tiny_model("llama"), num_slots=4096, eos_token_ids=list(eos), kv=kv)


def resumed(g):
    return GenerationRequest(PROMPTS[g.request_id], PARAMS.replace(n=1), g.request_id, seed_index=g.request_id,
                             resume=Resume(g.sample_index, g.token_ids, g.logp_sparse, g.kv.compressed_at))


def carried_to_the_end(eng, cutoff):
    """Every sample, generated in calls of at most `cutoff` each, each call resuming what the last one stopped."""
    done, segments = {}, []
    gens = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)], cutoff=cutoff)
    while gens:
        segments.append(gens)
        for g in gens:
            if g.finish_reason != "abort":
                done[(g.request_id, g.sample_index)] = g
        carried = [g for g in gens if g.finish_reason == "abort"]
        gens = eng.generate([resumed(g) for g in carried], cutoff=cutoff) if carried else []
    return done, segments


@pytest.mark.parametrize("kv", [None, RKV], ids=["dense", "rkv"])
def test_carried_samples_draw_what_one_uninterrupted_call_draws(kv):
    eng = engine(kv)
    ref = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)])
    new_tokens = eng.stats().new_tokens
    eng.reset_stats()
    done, segments = carried_to_the_end(eng, Cutoff(max_tokens=7))
    assert len(segments) >= 3  # some sample crossed two boundaries
    for r in ref:
        g = done[(r.request_id, r.sample_index)]
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason
        assert max(abs(a - b) for a, b in zip(g.logp_sparse, r.logp_sparse)) < LOGP_TOL
        assert g.kv.compressed_at == r.kv.compressed_at
    # Each carried segment comes back with the earlier tokens and log-probs exactly as they were handed in.
    for before, after in zip(segments, segments[1:]):
        stopped = {(g.request_id, g.sample_index): g for g in before if g.finish_reason == "abort"}
        for g in after:
            old = stopped[(g.request_id, g.sample_index)]
            assert g.token_ids[: len(old.token_ids)] == old.token_ids
            assert g.logp_sparse[: len(old.logp_sparse)] == old.logp_sparse
    if kv is not None:  # recompaction on resume happened, before a boundary
        assert any(c <= len(s.token_ids) for seg in segments[:-1] for s in seg if s.finish_reason == "abort"
                   for c in s.kv.compressed_at)
    assert eng.stats().new_tokens == new_tokens  # resumed tokens are not counted twice
    assert eng.pool.num_used == 0


def test_the_cutoff_stops_at_the_finished_share_and_spares_the_exempt():
    eng = engine(eos=(3, 17, 5, 9))  # the tiny model draws these now and then: responses of 3 to 40 tokens
    ref = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)])
    assert max(len(g.token_ids) for g in ref if g.request_id == 3) > sorted(len(g.token_ids) for g in ref)[3]
    gens = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)],
                        cutoff=Cutoff(finish_frac=0.5, exempt=frozenset({3})))
    ended = [g for g in gens if g.finish_reason != "abort"]
    assert 4 <= len(ended) < len(gens)
    for g, r in zip(gens, ref):
        assert g.token_ids == r.token_ids[: len(g.token_ids)]
        if g.request_id == 3:  # exempt: ran to its own end
            assert g.finish_reason == r.finish_reason and g.token_ids == r.token_ids
    # The share was reached early, but the others decode on while the exempt request runs, and stop when it ends.
    stopped = [g for g in gens if g.finish_reason == "abort"]
    exempt_end = max(len(g.token_ids) for g in gens if g.request_id == 3)
    assert stopped and all(len(g.token_ids) == exempt_end for g in stopped)
    cut = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)], cutoff=Cutoff(finish_frac=0.5))
    fourth = sorted(len(g.token_ids) for g in ref)[3]  # the share is reached when the fourth sample ends
    assert sum(g.finish_reason != "abort" for g in cut) >= 4
    assert all(len(g.token_ids) == fourth for g in cut if g.finish_reason == "abort")
    assert eng.pool.num_used == 0
    whole = eng.generate([GenerationRequest(p, PARAMS, i) for i, p in enumerate(PROMPTS)], cutoff=Cutoff(1.0))
    assert [g.token_ids for g in whole] == [g.token_ids for g in ref]  # finish_frac=1 never stops a call


def test_bad_resumes_are_refused_before_any_work():
    eng = engine()
    with pytest.raises(ValueError, match="n=1"):
        GenerationRequest([1, 2], PARAMS, 0, resume=Resume(0, [4], [-1.0]))
    params = PARAMS.replace(n=1, max_new_tokens=3)
    with pytest.raises(ValueError, match="nothing left to draw"):
        eng.generate([GenerationRequest([1, 2], params, "r", resume=Resume(0, [4, 5, 6], [-1.0] * 3))])
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        eng.generate([GenerationRequest([1, 2], params, "r", resume=Resume(0, [4, 5], [-1.0]))])
    assert eng.pool.num_used == 0 and eng.stats().new_tokens == 0


def test_a_resumed_sample_keeps_the_budget_it_was_drawn_under():
    """`rollout.kv.budget=auto` lowers the engine's budget between steps (`set_kv_budget`): a carried sample resumes
    under the budget it was drawn under (its replayed compactions need that schedule's room), new requests take the
    new one; a resume that brings no budget gets the dense worst case."""
    kv, params = RKV.with_budget(10), PARAMS.replace(n=1, max_new_tokens=24)
    eng = engine(kv, eos=())  # no stop token: every sample runs to the cap
    first = GenerationRequest(PROMPTS[0], params, 0)
    ref, = eng.generate([first])
    cut, = eng.generate([first], cutoff=Cutoff(max_tokens=20))
    assert cut.finish_reason == "abort" and len(cut.kv.compressed_at) >= 2 and cut.kv.kv_budget == 10
    eng.set_kv_budget(5)
    resume = lambda budget: Resume(0, cut.token_ids, cut.logp_sparse, cut.kv.compressed_at, budget)  # noqa: E731
    g, lowered = eng.generate([GenerationRequest(PROMPTS[0], params, 0, resume=resume(10)),
                               GenerationRequest(PROMPTS[1], params, 1)])
    # Weights unchanged: the uninterrupted sample, compactions included.
    assert g.token_ids == ref.token_ids and g.kv.compressed_at == ref.kv.compressed_at and g.kv.kv_budget == 10
    assert max(abs(a - b) for a, b in zip(g.logp_sparse, ref.logp_sparse)) < LOGP_TOL
    assert lowered.kv.kv_budget == 5 and lowered.kv.peak_slots < ref.kv.peak_slots  # a new request: the new budget
    # No budget brought: the current one's schedule on the dense worst case (its first stretch outgrows budget 5's).
    g, = eng.generate([GenerationRequest(PROMPTS[0], params, 0, resume=resume(None))])
    assert g.finish_reason == "length" and g.kv.kv_budget == 5 and eng.pool.num_used == 0
    with pytest.raises(ValueError, match="kv_budget must be a positive int"):
        eng.generate([GenerationRequest(PROMPTS[0], params, 0, resume=resume(0))])
