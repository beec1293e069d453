"""Sampling behaviour of the SGLang engine: seeds, batch independence, stop tokens and strings, EOS."""
import pytest

from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.sglang.conftest import build_tiny
from tests.sglang.test_parity import PROMPTS, requests
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON, HostError

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)


@pytest.fixture
def host(hosts):
    h = hosts("llama")
    h.set_seed(0)
    return h


def tokens(gens):
    return [g.token_ids for g in gens]


def test_n_samples_differ_and_repeat_with_the_same_seed(host):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=11, ignore_eos=True)
    a = host.generate(requests(params))
    assert [(g.request_id, g.sample_index) for g in a[:4]] == [("r0", j) for j in range(4)]
    assert len({tuple(g.token_ids) for g in a[:4]}) == 4
    b = host.generate(requests(params))
    assert tokens(a) == tokens(b)
    # Log-probs repeat up to fp32 noise: the second call finds the prompts in SGLang's prefix cache.
    assert max(abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga.logp_sparse, gb.logp_sparse)) < 1e-5
    assert tokens(host.generate(requests(params.replace(seed=12)))) != tokens(a)


def test_engine_seed_drives_requests_without_a_seed(host):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, ignore_eos=True)
    a = host.generate(requests(params))
    host.set_seed(5)
    b = host.generate(requests(params))
    host.set_seed(0)
    assert tokens(host.generate(requests(params))) == tokens(a) != tokens(b)


def test_a_sample_does_not_depend_on_its_batch(host):
    # Draws are keyed by (sequence seed, position): the same request alone or among others samples the same.
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    together = host.generate(requests(params))
    alone = host.generate([GenerationRequest(PROMPTS[0], params, "r0")])
    assert alone[0].token_ids == together[0].token_ids


def test_stop_token_ids_and_strings(host, tokenizer):
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    full = host.generate(requests(greedy, PROMPTS[:1]))[0].token_ids
    stop = full[3]
    for ignore_eos in (True, False):  # SGLang drops stop ids under ignore_eos; the engine still honours them
        g = host.generate(requests(greedy.replace(stop_token_ids=(stop,), ignore_eos=ignore_eos), PROMPTS[:1]))[0]
        cut = full.index(stop) + 1
        assert g.token_ids == full[:cut] and g.finish_reason == "stop" and len(g.logp_sparse) == cut
    text = tokenizer.decode(full[4:6])
    g = host.generate(requests(greedy.replace(stop_strings=(text,)), PROMPTS[:1]))[0]
    assert g.finish_reason == "stop" and text in g.text and g.token_ids == full[: len(g.token_ids)]
    assert len(g.token_ids) < len(full) and len(g.logp_sparse) == len(g.token_ids)


def test_eos_stops_unless_ignored(host, tokenizer):
    # Make EOS the greedy choice by step 4 (its LM-head row a scaled copy of the 4th greedy token's), then restore.
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    full = host.generate(requests(greedy.replace(ignore_eos=True), PROMPTS[:1]))[0].token_ids
    eos = tokenizer.eos_token_id
    assert eos not in full
    head = build_tiny("llama", tokenizer).state_dict()["lm_head.weight"]
    steered = head.clone()
    steered[eos] = 50 * head[full[3]]
    host.update_weights([("lm_head.weight", steered)])
    try:
        g = host.generate(requests(greedy, PROMPTS[:1]))[0]
        assert g.finish_reason == "stop" and g.token_ids[-1] == eos and len(g.token_ids) <= 4
        assert g.token_ids[:-1] == full[: len(g.token_ids) - 1]
        forced = host.generate(requests(greedy.replace(ignore_eos=True), PROMPTS[:1]))[0]
        assert forced.finish_reason == "length" and len(forced.token_ids) == 12 and eos in forced.token_ids
    finally:
        host.update_weights([("lm_head.weight", head)])
    assert host.generate(requests(greedy.replace(ignore_eos=True), PROMPTS[:1]))[0].token_ids == full


def test_bad_requests_raise_in_the_caller(host):
    with pytest.raises(HostError, match="empty prompt"):
        host.generate([GenerationRequest([], SamplingParams(max_new_tokens=4), "empty")])
