"""Native engine sessions: a multi-turn trajectory keeps its KV between turns and prefills only the new tokens.

Every check runs the real engine on a tiny random model; the reference is the same engine re-prefilling the
whole history each turn (what the env loop does without sessions).
"""
import pytest

from sparserl.kv import KVPolicyConfig
from sparserl.engines.protocol import supports_sessions
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.sequence import Sequence
from sparserl.engines.native.sessions import Session, choose_victims
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13]]
OBS = [20, 21, 22, 23, 24]  # the scripted env's observation, appended after every turn
TURNS = 3


def make_engine(num_slots=1024, kv=None, seed=0):
    return NativeEngine(tiny_model("llama", seed=seed), num_slots=num_slots, eos_token_ids=[], kv=kv)


def episodes(engine, params_of, sessions, turns=TURNS, prompts=PROMPTS, keep_last=False):
    """Run `turns` turns of every prompt; returns per turn the generations and the prompts sent."""
    history = [list(p) for p in prompts]
    out = []
    for t in range(turns):
        keep = sessions and (keep_last or t < turns - 1)
        reqs = [GenerationRequest(h, params_of(i), i, session_id=f"ep{i}" if sessions else None, keep_session=keep)
                for i, h in enumerate(history)]
        gens = engine.generate(reqs)
        out.append((gens, [list(h) for h in history]))
        history = [h + g.token_ids + OBS for h, g in zip(history, gens)]
    return out


def assert_same_samples(a, b, tol=1e-5):
    for (ga, _), (gb, _) in zip(a, b):
        for x, y in zip(ga, gb):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logp_sparse, y.logp_sparse)) < tol


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continued_turns_match_reprefilling_the_history(temperature):
    # Different prompt and response lengths per trajectory, all decoding in the same batches.
    max_new = [12, 7, 16]
    params_of = lambda i: SamplingParams(temperature=temperature, max_new_tokens=max_new[i], seed=3)  # noqa: E731
    cont, ref = make_engine(), make_engine()
    assert supports_sessions(cont)
    with_sessions = episodes(cont, params_of, sessions=True)
    reprefill = episodes(ref, params_of, sessions=False)
    assert_same_samples(with_sessions, reprefill)

    # Prefill: each trajectory's first prompt once, then only the last sampled token and the observation.
    firsts = sum(len(p) for p in PROMPTS)
    assert cont.stats().prefill_tokens == firsts + (TURNS - 1) * len(PROMPTS) * (1 + len(OBS))
    assert ref.stats().prefill_tokens == sum(len(h) for _, hist in reprefill for h in hist)
    assert cont.stats().prefill_tokens < ref.stats().prefill_tokens / 2
    reused = [g.kv.reused_tokens for gens, _ in with_sessions[1:] for g in gens]
    held_before = [len(h) - 1 - len(OBS) for _, hist in with_sessions[1:] for h in hist]  # history minus its new tokens
    assert reused == held_before
    assert cont.stats().sessions_continued == (TURNS - 1) * len(PROMPTS)
    assert cont.stats().session_reused_tokens == sum(reused)
    # The first turns' generations name their sessions; the last turn released them.
    assert [g.session_id for g in with_sessions[0][0]] == ["ep0", "ep1", "ep2"]
    assert all(g.session_id is None for g in with_sessions[-1][0])
    assert len(cont.sessions) == 0 and cont.pool.num_free == cont.num_slots


def test_n_samples_open_one_session_each():
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=1)
    engine, ref = make_engine(), make_engine()
    first = engine.generate([GenerationRequest(PROMPTS[0], params, "q", session_id="q", keep_session=True)])
    first_ref = ref.generate([GenerationRequest(PROMPTS[0], params, "q")])
    assert [g.session_id for g in first] == [("q", 0), ("q", 1), ("q", 2)]
    assert [g.token_ids for g in first] == [g.token_ids for g in first_ref]
    # Held: each sample its own copy of prompt + response minus the last token.
    assert engine.pool.num_used == 3 * (len(PROMPTS[0]) + 6 - 1)
    # Each trajectory goes on alone (n=1), as the env loop sends later turns.
    one = params.replace(n=1, temperature=0.0)
    nxt = engine.generate([GenerationRequest(PROMPTS[0] + g.token_ids + OBS, one, k, session_id=g.session_id)
                           for k, g in enumerate(first)])
    nxt_ref = ref.generate([GenerationRequest(PROMPTS[0] + g.token_ids + OBS, one, k) for k, g in enumerate(first_ref)])
    assert [g.token_ids for g in nxt] == [g.token_ids for g in nxt_ref]
    assert all(g.kv.reused_tokens == len(PROMPTS[0]) + 5 for g in nxt)
    assert engine.pool.num_used == 0 and len(engine.sessions) == 0


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "streaming"])
def test_compression_configured_but_not_triggered_continues_exactly(policy):
    # Budget above every length: the carried compressor state (positions, query window) changes nothing.
    kv = KVPolicyConfig(algorithm=policy, budget=256, window=4, divide_length=8, kernel=3, sinks=2)
    params_of = lambda i: SamplingParams(temperature=0.0, max_new_tokens=10)  # noqa: E731
    cont = episodes(make_engine(kv=kv), params_of, sessions=True)
    assert_same_samples(cont, episodes(make_engine(), params_of, sessions=False))


def test_rkv_sessions_keep_the_cache_under_the_budget_bound():
    budget, divide = 16, 8
    kv = KVPolicyConfig(algorithm="rkv", budget=budget, window=4, divide_length=divide, kernel=3)
    params_of = lambda i: SamplingParams(temperature=1.0, max_new_tokens=30, seed=i)  # noqa: E731
    engine, ref = make_engine(kv=kv), make_engine(kv=kv)
    cont = episodes(engine, params_of, sessions=True)
    reprefill = episodes(ref, params_of, sessions=False)
    delta = 1 + len(OBS)  # new tokens of a continued turn
    bound = budget + divide + delta  # held cache <= budget + divide, plus this turn's new tokens
    for t, (gens, history) in enumerate(cont):
        for g, h in zip(gens, history):
            assert g.kv.peak_slots <= bound, (t, g.kv)
            assert g.kv.retained_tokens <= budget + divide
            assert g.kv.compressions >= 1
            assert g.kv.total_tokens == len(h) + len(g.token_ids) - 1  # the true length, not the cache's
    # Re-prefilling holds the whole history at every later turn; the continued cache does not grow with it.
    assert all(g.kv.peak_slots > bound for g in reprefill[-1][0])
    assert engine.stats().peak_slots <= len(PROMPTS) * bound < ref.stats().peak_slots
    assert engine.stats().prefill_tokens < ref.stats().prefill_tokens
    assert all(all(x <= 0.0 for x in g.logp_sparse) and len(g.logp_sparse) == 30 for gens, _ in cont for g in gens)
    assert engine.pool.num_used == 0


def test_compressed_session_continues_at_its_true_positions():
    # StreamingLLM keeps sinks + the most recent tokens, so which logical positions survive is known exactly.
    kv = KVPolicyConfig(algorithm="streaming", budget=12, window=4, divide_length=4, sinks=2)
    engine = make_engine(kv=kv)
    positions = []
    hook = engine.runner.model.register_forward_pre_hook(
        lambda mod, args, kwargs: positions.append(kwargs["position_ids"][0].tolist()), with_kwargs=True)
    params_of = lambda i: SamplingParams(temperature=0.0, max_new_tokens=20)  # noqa: E731
    prompts = [PROMPTS[0]]
    out = episodes(engine, params_of, sessions=True, prompts=prompts, keep_last=True)
    hook.remove()
    session = engine.sessions.get("ep0")
    length = len(prompts[0]) + TURNS * 20 + (TURNS - 1) * len(OBS) - 1  # every token but the last sampled one
    assert session.tokens == (out[-1][1][0] + out[-1][0][0].token_ids)[:-1] and len(session.tokens) == length
    carry = session.carry
    kept = carry.kept_positions  # (layers, H_kv, K): sinks and the most recent tokens at the last compression
    tail = list(range(carry.appended_from, length))
    assert len(session.slots) == kept.shape[-1] + len(tail)
    for row in kept.reshape(-1, kept.shape[-1]).tolist():
        assert row[:2] == [0, 1] and row[2:] == list(range(carry.appended_from - len(row) + 2, carry.appended_from))
    # RoPE continues from the true length: each continued turn's prefill starts where the history ends.
    for gens, history in out[1:]:
        start = len(history[0]) - 1 - len(OBS)
        assert [start + k for k in range(1 + len(OBS))] in positions
    assert engine.end_sessions() == 1 and engine.pool.num_used == 0


def test_slot_accounting_end_sessions_sleep_and_weight_updates():
    engine = make_engine(num_slots=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    gens = engine.generate([GenerationRequest(p, params, i, session_id=k, keep_session=True)
                            for i, (p, k) in enumerate(zip(PROMPTS, "abc"))])
    held = {k: len(p) + 6 - 1 for p, k in zip(PROMPTS, "abc")}
    assert engine.pool.num_used == sum(held.values()) == engine.sessions.held_slots
    assert engine.end_sessions(["a", "unknown"]) == 1
    assert engine.pool.num_used == held["b"] + held["c"]
    # A session's continuation sees the others' held slots in the pool and leaves the count where it belongs.
    engine.generate([GenerationRequest(PROMPTS[1] + gens[1].token_ids + OBS, params, 0, session_id="b", keep_session=True)])
    assert engine.pool.num_used == engine.sessions.held_slots == held["c"] + len(PROMPTS[1]) + 6 + len(OBS) + 6 - 1
    # New weights make held KV stale: update_weights ends every session; so does sleep.
    engine.update_weights((n, t.clone()) for n, t in tiny_model("llama", seed=0).state_dict().items())
    assert len(engine.sessions) == 0 and engine.pool.num_free == engine.num_slots
    engine.generate([GenerationRequest(PROMPTS[0], params, 0, session_id="a", keep_session=True)])
    assert engine.pool.num_used > 0
    engine.sleep()
    assert len(engine.sessions) == 0 and engine.pool.num_free == engine.num_slots
    engine.wake()
    # A key the engine no longer holds is simply prefilled from scratch.
    g = engine.generate([GenerationRequest(PROMPTS[0] + [1, 2, 3], params, 0, session_id="a")])[0]
    assert g.kv.reused_tokens == 0 and g.session_id is None
    assert engine.end_sessions() == 0 and engine.pool.num_free == engine.num_slots


def test_a_prompt_that_does_not_extend_the_session_is_refused():
    engine = make_engine(num_slots=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    g = engine.generate([GenerationRequest(PROMPTS[0], params, "r", session_id="s", keep_session=True)])[0]
    used = engine.pool.num_used
    good = PROMPTS[0] + g.token_ids + OBS
    bad = list(good)
    bad[2] += 1
    with pytest.raises(ValueError, match=r"'r'.*do not extend the 9 tokens held for session 's' \(token 2 is 8"):
        engine.generate([GenerationRequest(bad, params, "r", session_id="s")])
    with pytest.raises(ValueError, match="nothing after them"):
        engine.generate([GenerationRequest(good[:9], params, "r", session_id="s")])
    with pytest.raises(ValueError, match="continued turn has n=1"):
        engine.generate([GenerationRequest(good, params.replace(n=2), "r", session_id="s")])
    with pytest.raises(ValueError, match="appears twice"):
        engine.generate([GenerationRequest(good, params, 0, session_id="s"), GenerationRequest(good, params, 1, session_id="s")])
    with pytest.raises(ValueError, match="keep_session=True needs a session_id"):
        GenerationRequest(good, params, "r", keep_session=True)
    # A refused call changes nothing: the session is still held and continues normally.
    assert engine.pool.num_used == used and "s" in engine.sessions
    g2 = engine.generate([GenerationRequest(good, params, "r", session_id="s")])[0]
    assert g2.kv.reused_tokens == len(PROMPTS[0]) + 5 - 1
    assert engine.pool.num_free == engine.num_slots


def test_pool_pressure_drops_sessions_and_reprefills_them():
    params_of = lambda i: SamplingParams(temperature=0.0, max_new_tokens=12)  # noqa: E731
    # 70 slots: the three trajectories' first turns fit (16 + 13 + 24 reserved), their held histories and
    # continued turns do not all fit at once.
    engine, ref = make_engine(num_slots=70), make_engine()
    engine.trace = []
    cont = episodes(engine, params_of, sessions=True)
    assert_same_samples(cont, episodes(ref, params_of, sessions=False))
    st = engine.stats()
    assert st.sessions_dropped > 0 and st.sessions_continued > 0
    assert st.sessions_continued + st.sessions_dropped <= (TURNS - 1) * len(PROMPTS)
    assert max(t.pool_high_water for t in engine.trace) <= 70
    assert engine.pool.num_free == engine.num_slots


def test_an_error_inside_generate_frees_the_call_and_keeps_other_sessions():
    engine = make_engine(num_slots=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = engine.generate([GenerationRequest(p, params, i, session_id=k, keep_session=True)
                             for i, (p, k) in enumerate(zip(PROMPTS[:2], "ab"))])
    a_slots = len(engine.sessions.get("a").slots)
    calls = []

    def fail_on_third_forward(mod, args, kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")

    hook = engine.runner.model.register_forward_pre_hook(fail_on_third_forward, with_kwargs=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.generate([GenerationRequest(PROMPTS[1] + first[1].token_ids + OBS, params, 0, session_id="b", keep_session=True),
                         GenerationRequest(PROMPTS[2], params, 1, session_id="c", keep_session=True)])
    hook.remove()
    # "a" was not part of the failed call and is intact; "b" (continued) and "c" (new) are gone, no slot leaked.
    assert "a" in engine.sessions and "b" not in engine.sessions and "c" not in engine.sessions
    assert engine.pool.num_used == a_slots
    ref = make_engine()
    want = ref.generate([GenerationRequest(PROMPTS[0] + first[0].token_ids + OBS, params, 0)])[0]
    got = engine.generate([GenerationRequest(PROMPTS[0] + first[0].token_ids + OBS, params, 0, session_id="a")])[0]
    assert got.token_ids == want.token_ids and got.kv.reused_tokens > 0
    assert engine.pool.num_free == engine.num_slots


def test_eviction_order_is_idle_lru_then_the_back_of_the_queue():
    params = SamplingParams(max_new_tokens=4)
    idle = [Session("old", [1] * 5, [0, 1, 2], None, 1), Session("new", [1] * 5, [3, 4], None, 2)]
    waiting = [Sequence(k, k, 0, [1] * 9, params, 20, reused=5, slots=list(range(10 * k, 10 * k + 4))) for k in range(3)]
    fresh = Sequence(9, 9, 0, [1] * 9, params, 20)
    head = waiting[0]
    assert choose_victims(idle, waiting, head, 2, lambda s: True) == idle[:1]
    assert choose_victims(idle, waiting, head, 6, lambda s: True) == idle + [waiting[2]]
    # The head itself, sequences that continue nothing, and ones whose re-prefill cannot fit are never chosen.
    assert choose_victims(idle, waiting + [fresh], head, 9, lambda s: s is not waiting[2]) == idle + [waiting[1]]
    assert choose_victims(idle, waiting, head, 14, lambda s: True) == []  # not enough: drop nothing


def test_sglang_backend_declares_no_sessions():
    from sparserl.engines.sglang.engine import SGLangEngine

    assert SGLangEngine.supports_sessions is False
    assert not supports_sessions(object())  # engines that predate the flag re-prefill
