"""The native engine against transformers itself: greedy tokens, sampler log-probs, batching, errors."""
import pytest
import torch

from sparserl.engines.registry import build_engine
from sparserl.engines.native.engine import NativeEngine
from sparserl.model.sampling import processed_logprobs
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6], [9, 8, 7, 6, 5, 4, 3]]


def requests(params, prompts=PROMPTS):
    return [GenerationRequest(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]


def dense_logprobs(model, gen, temperature, top_p=1.0):
    """The dense forward's processed log-probs of `gen`'s tokens, on the model's device; returned on the CPU."""
    device = next(model.parameters()).device
    ids = torch.tensor([gen.prompt_token_ids + gen.token_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(gen.prompt_token_ids) - 1 : -1]
    lp = processed_logprobs(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(gen.token_ids, device=device)[:, None])[:, 0].cpu()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers_generate(family):
    ref = tiny_model(family)
    engine = NativeEngine(tiny_model(family), num_slots=512, eos_token_ids=[])
    gens = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16)))
    assert [g.request_id for g in gens] == [f"r{i}" for i in range(len(PROMPTS))]
    for p, g in zip(PROMPTS, gens):
        out = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert g.token_ids == out[0, len(p) :].tolist()
        assert g.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logprobs_match_dense_forward(family, temperature, top_p):
    ref = tiny_model(family)
    engine = NativeEngine(tiny_model(family), num_slots=1024, eos_token_ids=[])
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24, n=3, seed=7)
    gens = engine.generate(requests(params))
    assert len(gens) == 3 * len(PROMPTS)
    worst = 0.0
    for g in gens:
        worst = max(worst, (dense_logprobs(ref, g, temperature, top_p) - torch.tensor(g.logp_sparse)).abs().max().item())
    assert worst < 1e-5
    # The n samples of one prompt differ (they are real draws, not copies of the first).
    assert len({tuple(g.token_ids) for g in gens[:3]}) > 1


def test_top_p_logprob_is_renormalized_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    lp = processed_logprobs(logits, 1.0, top_p=0.8)[0]
    kept = p[:2] / p[:2].sum()  # 0.644 + 0.237 = 0.881 >= 0.8: two tokens kept
    assert torch.allclose(lp[:2].exp(), kept, atol=1e-6)
    assert torch.isinf(lp[2:]).all()
    lp_k = processed_logprobs(logits, 0.5, top_k=3)[0]
    assert torch.isinf(lp_k[3]) and torch.allclose(lp_k[:3].exp().sum(), torch.tensor(1.0))


def test_seed_reproducible_and_batch_independent():
    model = tiny_model("llama")
    engine = NativeEngine(model, num_slots=1024, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    a = engine.generate(requests(params))
    b = engine.generate(requests(params))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    c = engine.generate(requests(params.replace(seed=4)))
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_seed_index_keys_draws_independently_of_position():
    engine = NativeEngine(tiny_model("llama"), num_slots=1024, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5)
    full = engine.generate([GenerationRequest(p, params, i, seed_index=100 + i) for i, p in enumerate(PROMPTS)])
    # The same prompts split in two batches and in another order (as ranks would get them): the same draws.
    odd = engine.generate([GenerationRequest(PROMPTS[i], params, i, seed_index=100 + i) for i in (3, 1)])
    even = engine.generate([GenerationRequest(PROMPTS[i], params, i, seed_index=100 + i) for i in (4, 2, 0)])
    by_key = {(g.request_id, g.sample_index): g.token_ids for g in odd + even}
    assert {(g.request_id, g.sample_index): g.token_ids for g in full} == by_key
    # Without a seed index the position keys the stream: moving a prompt changes its draws.
    moved = engine.generate([GenerationRequest(PROMPTS[i], params, i) for i in (3, 1)])
    plain = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(PROMPTS)])
    assert moved[0].token_ids != plain[3].token_ids


def test_continuous_batching_admits_into_freed_slots():
    engine = NativeEngine(tiny_model("llama"), num_slots=30, eos_token_ids=[], admission="reserve")
    engine.trace = []
    # Each request reserves prompt + max_new - 1 slots (7, 19, 11, 15, 9): only two fit 30 slots at first.
    lengths = [4, 16, 8, 12, 6]
    reqs = [GenerationRequest([1 + i, 2, 3, 4], SamplingParams(temperature=1.0, max_new_tokens=m, seed=i), i)
            for i, m in enumerate(lengths)]
    gens = engine.generate(reqs)
    assert [len(g.token_ids) for g in gens] == lengths
    admitted_at = {req: t.step for t in engine.trace for (req, _) in t.admitted}
    finished_at = {req: t.step for t in engine.trace for (req, _) in t.finished}
    assert admitted_at[0] == admitted_at[1] == 0 and 2 not in [r for r, _ in engine.trace[0].admitted]
    # Request 2 enters right after request 0 finishes, while request 1 is still decoding.
    assert admitted_at[2] == finished_at[0] + 1
    assert admitted_at[2] < finished_at[1]
    assert any(len(t.admitted) and len(t.decoding) for t in engine.trace[1:]), "prefill and decode share a step"
    assert max(t.pool_high_water for t in engine.trace) <= 30
    assert engine.trace[-1].slots_used == 0
    assert engine.stats().peak_slots <= 30


def test_forked_siblings_share_the_prompt_prefill():
    engine = NativeEngine(tiny_model("llama"), num_slots=512, eos_token_ids=[])
    engine.trace = []
    gens = engine.generate([GenerationRequest([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=5, n=4, seed=0), "x")])
    assert [g.sample_index for g in gens] == [0, 1, 2, 3]
    assert sorted(engine.trace[0].admitted) == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_stop_tokens_and_strings():
    model = tiny_model("llama")
    engine = NativeEngine(model, num_slots=512, eos_token_ids=[])
    greedy = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16)))[0].token_ids
    stop_tok = greedy[5]
    g = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop_tok])))[0]
    assert g.finish_reason == "stop" and g.token_ids == greedy[: greedy.index(stop_tok) + 1]
    engine_eos = NativeEngine(model, num_slots=512, eos_token_ids=[stop_tok])
    assert engine_eos.generate(requests(SamplingParams(temperature=0, max_new_tokens=16)))[0].finish_reason == "stop"
    ignored = engine_eos.generate(requests(SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 16


class CharTokenizer:
    """Maps token id i to the character chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_ends_the_sequence():
    model = tiny_model("llama")
    engine = NativeEngine(model, tokenizer=CharTokenizer(), num_slots=512, eos_token_ids=[])
    greedy = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16)))[0]
    target = greedy.text[6:8]
    g = engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=16, stop_strings=[target])))[0]
    assert g.finish_reason == "stop" and g.text.endswith(target) and len(g.token_ids) <= 8


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GenerationRequest([], SamplingParams()), "empty prompt"),
        (lambda: GenerationRequest(list(range(1, 100)), SamplingParams(max_new_tokens=8)), "needs up to 106 KV slots"),
        (lambda: GenerationRequest([1], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (lambda: GenerationRequest([1], SamplingParams(max_new_tokens=-3)), "max_new_tokens"),
        (lambda: GenerationRequest([1], SamplingParams(stop_strings=[5])), "stop_strings"),
    ],
)
def test_bad_input_errors(make, match):
    engine = NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[])
    with pytest.raises((ValueError, TypeError), match=match):
        engine.generate([make()])


def test_update_weights_sleep_wake():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = build_engine("native", model=a, num_slots=256, eos_token_ids=[])
    params = SamplingParams(temperature=0, max_new_tokens=10)
    engine.update_weights((n, t.clone()) for n, t in b.state_dict().items())
    want = b.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(requests(params))
    engine.wake()
    assert engine.generate(requests(params))[0].token_ids == want[0, len(PROMPTS[0]) :].tolist()
    with pytest.raises(KeyError, match="no parameter named"):
        engine.update_weights([("nope.weight", torch.zeros(1))])


def test_sleep_can_release_the_weights_until_the_next_update():
    model = tiny_model("llama", seed=0)
    saved = {n: t.clone() for n, t in model.state_dict().items()}
    engine = build_engine("native", model=model, num_slots=256, eos_token_ids=[], release_weights=True)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    before = [g.token_ids for g in engine.generate(requests(params))]
    engine.sleep()
    assert all(p.numel() == 0 for p in model.parameters())  # the storage is gone while the actor trains
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.wake()
    engine.update_weights(list(saved.items())[:3])  # a first bucket: still incomplete
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.wake()
    engine.update_weights(list(saved.items())[3:])
    engine.wake()
    assert [g.token_ids for g in engine.generate(requests(params))] == before


def test_bf16_runs_and_tracks_fp32():
    engine = NativeEngine(tiny_model("llama", dtype=torch.bfloat16), num_slots=512, eos_token_ids=[])
    gens = engine.generate(requests(SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)))
    ref = tiny_model("llama", dtype=torch.bfloat16)
    for g in gens:
        assert (dense_logprobs(ref, g, 1.0) - torch.tensor(g.logp_sparse)).abs().max() < 0.1
    assert engine.stats().kv_bytes_per_slot == 2 * 2 * 2 * 16 * 2  # K+V, layers, kv heads, head dim, bf16


@pytest.mark.parametrize("decode_cache", ["on", "off"])
def test_unwritten_pool_slots_are_never_read(decode_cache):
    # On CPU the KV pool is allocated without zero-filling (resident memory follows the slots in use), so its
    # unwritten slots hold whatever the memory held. Fill every slot but slot 0 with NaN, as recycled memory could
    # be, and run sequences that finish at different steps (row reuse, padded decode gathers): the tokens and
    # log-probs must equal those of an engine whose pool is all zeros.
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=10 + 3 * i, seed=i, n=2), i)
            for i, p in enumerate(PROMPTS)]
    outs = []
    for fill in (0.0, float("nan")):
        engine = NativeEngine(tiny_model("llama"), num_slots=60, eos_token_ids=[7, 9], decode_cache=decode_cache)
        engine.runner.allocate()
        for t in engine.runner.k_cache + engine.runner.v_cache:
            t[1:].fill_(fill)
            assert torch.count_nonzero(t[0]) == 0, "slot 0 is zeroed: padded decode gathers read it"
        outs.append(engine.generate(reqs))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.logp_sparse == b.logp_sparse
    assert len({len(g.token_ids) for g in outs[0]}) > 2
