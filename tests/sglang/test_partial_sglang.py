"""Partial rollouts on the SGLang engine (engines/sglang/engine.py): a call under a `Cutoff` stops the samples still
running once enough have ended (SGLang's abort) and returns what they drew, `max_tokens` caps a sample's tokens in the
call, an exempt request runs to its end, and a resumed sample draws on from its own keyed stream: dense, with the
weights unchanged, stopped + resumed samples are the uninterrupted ones."""
import pytest

from sparserl.engines.types import Cutoff, GenerationRequest, Resume, SamplingParams
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON
from tests.sglang.test_parity import PROMPTS

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)
LOGP_TOL = 1e-4  # a resumed sample's re-prefilled cache is computed in other batches (fp32 noise)
LENGTHS = (4, 6, 8, 40, 40)  # each prompt's max_new_tokens: three end early, two run long


def calls(params):
    return [GenerationRequest(p, params.replace(max_new_tokens=m), request_id=f"r{i}")
            for i, (p, m) in enumerate(zip(PROMPTS, LENGTHS))]


def test_stopped_samples_resume_into_the_uninterrupted_ones(hosts):
    host = hosts("llama")
    params = SamplingParams(temperature=1.0, n=2, seed=3, ignore_eos=True)
    whole = {(g.request_id, g.sample_index): g for g in host.generate(calls(params))}
    assert [len(whole[(f"r{i}", 0)].token_ids) for i in range(5)] == list(LENGTHS)

    # half of the 10 samples ended (r0, r1 and one of r2 at 4, 6 and 8 tokens): the others are stopped
    share = {(g.request_id, g.sample_index): g for g in host.generate(calls(params), Cutoff(finish_frac=0.5))}
    stopped = {k: g for k, g in share.items() if g.finish_reason == "abort"}
    assert {k[0] for k in stopped} >= {"r3", "r4"} and not {k[0] for k in stopped} & {"r0", "r1"}
    assert all(len(g.token_ids) < 40 for g in stopped.values())
    # at most 3 new tokens each, except r4, exempt: it runs to its end, and while it runs nothing else is stopped
    capped = {(g.request_id, g.sample_index): g
              for g in host.generate(calls(params), Cutoff(finish_frac=0.1, max_tokens=3, exempt=frozenset({4})))}
    assert all(g.finish_reason == "length" and len(g.token_ids) == 40 for k, g in capped.items() if k[0] == "r4")
    assert all(g.finish_reason == "abort" and len(g.token_ids) == 3 for k, g in capped.items() if k[0] != "r4")
    for part in (share, capped):
        for k, g in part.items():  # what a stopped sample drew is the start of the uninterrupted one
            assert g.token_ids == whole[k].token_ids[: len(g.token_ids)], k

    for part in (stopped, {k: g for k, g in capped.items() if g.finish_reason == "abort"}):
        resumed = [GenerationRequest(PROMPTS[int(k[0][1:])], params.replace(n=1, max_new_tokens=LENGTHS[int(k[0][1:])]),
                                     request_id=k, seed_index=int(k[0][1:]), resume=Resume(k[1], g.token_ids, g.logp_sparse))
                   for k, g in part.items()]
        for g in host.generate(resumed):
            ref, brought = whole[g.request_id], part[g.request_id]
            assert g.sample_index == g.request_id[1] and g.prompt_token_ids == ref.prompt_token_ids
            assert g.token_ids == ref.token_ids and g.finish_reason == "length", g.request_id
            assert g.logp_sparse[: len(brought.token_ids)] == brought.logp_sparse  # carried log-probs as they were
            assert max(abs(x - y) for x, y in zip(g.logp_sparse, ref.logp_sparse)) < LOGP_TOL
