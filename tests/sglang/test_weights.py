"""Weight updates (bucketed, fused q/k/v and gate/up through SGLang's loaders), sleep / wake, stats."""
import pytest
import torch

from sparserl.engines.types import SamplingParams
from tests.sglang.conftest import FAMILIES, build_tiny
from tests.sglang.test_parity import PROMPTS, requests
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON, HostError

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4, ignore_eos=True)


def hf_greedy(model):
    return [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


def outputs(host):
    return [(g.token_ids, g.logp_sparse) for g in host.generate(requests(GREEDY)) + host.generate(requests(SAMPLED))]


def same(a, b) -> bool:
    """Tokens identical, log-probs equal up to fp32 noise (prefix-cache hits change the batch shapes)."""
    return all(ta == tb and max(abs(x - y) for x, y in zip(la, lb)) < 1e-5 for (ta, la), (tb, lb) in zip(a, b))


@pytest.mark.parametrize("family", FAMILIES)
def test_update_changes_output_and_restoring_restores_it(family, hosts, tokenizer):
    host = hosts(family)
    before = outputs(host)
    other = build_tiny(family, tokenizer, seed=1)
    # Small buckets: many update_weights_from_tensor calls inside one begin/end session, as sync_weights sends them.
    host.update_weights(other.state_dict().items(), bucket_mb=0.05)
    greedy_new = [g.token_ids for g in host.generate(requests(GREEDY))]
    assert greedy_new == hf_greedy(other)  # every tensor landed, under SGLang's fused names
    assert [t for t, _ in before[: len(PROMPTS)]] != greedy_new
    host.update_weights(build_tiny(family, tokenizer, seed=0).state_dict().items())
    assert same(outputs(host), before)  # tokens exactly, log-probs to fp32 noise


def test_partial_update_changes_only_that_projection(hosts, tokenizer):
    # One fused slice (k_proj inside qkv_proj, up_proj inside gate_up_proj) changes the output; putting it back restores it.
    host = hosts("llama")
    base = build_tiny("llama", tokenizer)
    state = base.state_dict()
    before = outputs(host)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        host.update_weights([(name, state[name] * 3.0)])
        assert not same(outputs(host), before)
        host.update_weights([(name, state[name])])
        assert same(outputs(host), before)


def test_sleep_update_wake_cycle(hosts, tokenizer):
    host = hosts("qwen2")
    before = outputs(host)
    host.sleep()
    with pytest.raises(HostError, match="asleep"):
        host.generate(requests(GREEDY))
    with pytest.raises(HostError, match="released by sleep"):
        host.wake()  # the weights were released and nothing reloaded them
    host.update_weights(build_tiny("qwen2", tokenizer).state_dict().items())
    host.wake()
    assert same(outputs(host), before)


def test_stats_count_and_reset(hosts):
    host = hosts("llama")
    host.reset_stats()
    gens = host.generate(requests(SAMPLED))
    st = host.stats()
    assert st.new_tokens == sum(len(g.token_ids) for g in gens) == 12 * 2 * len(PROMPTS)
    assert st.prompt_tokens == sum(len(p) for p in PROMPTS) * 2
    assert st.generate_s > 0 and st.tok_per_s > 0 and st.pool_slots == 8192 and st.kv_bytes_per_slot > 0
    host.reset_stats()
    assert host.stats().new_tokens == 0
