"""rollout.kv.variant: `reference` scores SnapKV and R-KV as the public R-KV / Sparse-RL code does, `paper` as before.

Hand-computed cases: GQA max of logits vs mean of probabilities, a softmax over the candidates vs over every key
seen, the reference's R-KV redundancy (raw cosines, the newest similar entry of each row zeroed), raw vs
normalized head sums for shared sets; and that the variant reaches both engines' compaction through
`KVPolicyConfig`. Agreement with the reference code itself on random caches: benchmarks/kv_reference_agreement.py.
"""
import math

import pytest
import torch

from sparserl.config.load import load_config
from sparserl.kv import POLICIES, REFERENCE_POLICIES, KVPolicyConfig, register_policy, score_tokens, select_keep
from sparserl.kv.rkv import rkv_redundancy, rkv_reference_redundancy
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.sglang.kv_compactor import KVCompactor
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model


def cfg_for(algorithm, variant, **kw):
    kw.setdefault("kernel", 1)  # no pooling: the scores are the formulas below
    return KVPolicyConfig(algorithm=algorithm, variant=variant, **kw)


def softmax(xs):
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def gqa_case():
    """1 KV head, 2 query heads, window 1; keys e0..e3 (e3 the window), D = 4 so logits are q.k / 2.

    Query head 0 has logits [5, 4, 0, 0], query head 1 [0, 4, 0, 0]: key 0 has the single largest logit,
    key 1 the attention of both heads.
    """
    keys = torch.eye(4).unsqueeze(0)  # (1, 4, 4)
    queries = torch.zeros(2, 1, 4)
    queries[0, 0, 0], queries[0, 0, 1], queries[1, 0, 1] = 10.0, 8.0, 8.0
    return keys, queries, torch.arange(4).unsqueeze(0)


def test_snapkv_gqa_mean_of_probabilities_vs_max_of_logits():
    keys, queries, positions = gqa_case()
    paper = score_tokens(cfg_for("snapkv", "paper", budget=2, window=1), keys, queries, positions)[0, :3]
    ref = score_tokens(cfg_for("snapkv", "reference", budget=2, window=1), keys, queries, positions)[0, :3]
    # paper: each head's softmax over all 4 keys, averaged over the 2 heads (window of 1 row: the vote is that row)
    head0, head1 = softmax([5, 4, 0, 0]), softmax([0, 4, 0, 0])
    assert paper.tolist() == pytest.approx([(a + b) / 2 for a, b in zip(head0, head1)][:3], rel=1e-5)
    # reference: the max logit over the group, softmax over the 3 candidates only
    assert ref.tolist() == pytest.approx(softmax([5, 4, 0]), rel=1e-5)
    keep = lambda s: select_keep(s, 2, 1, shared=False).tolist()  # noqa: E731
    full = lambda v: score_tokens(cfg_for("snapkv", v, budget=2, window=1), keys, queries, positions)  # noqa: E731
    assert keep(full("paper")) == [[1, 3]]  # both heads attend to key 1
    assert keep(full("reference")) == [[0, 3]]  # the one largest logit wins


def test_snapkv_softmax_over_the_candidates_only():
    """MHA, window 2 (slots 3 and 4), keys orthonormal (D = 8). Query 3 looks mostly at itself, a little at key 0;
    query 4 a little at key 1. Over every key it sees, query 3's vote for key 0 is tiny; over the candidates it is
    renormalized and wins."""
    keys = torch.eye(8)[:5].unsqueeze(0)  # (1, 5, 8)
    scale = math.sqrt(8)
    queries = torch.zeros(1, 2, 8)
    queries[0, 0, 0], queries[0, 0, 3] = 4 * scale, 8 * scale  # logits [4, 0, 0, 8, (0: masked, in the future)]
    queries[0, 1, 1] = 2 * scale  # logits [0, 2, 0, 0, 0]
    positions = torch.arange(5).unsqueeze(0)
    paper = score_tokens(cfg_for("snapkv", "paper", budget=3, window=2), keys, queries, positions)[0, :3]
    ref = score_tokens(cfg_for("snapkv", "reference", budget=3, window=2), keys, queries, positions)[0, :3]
    row3, row4 = softmax([4, 0, 0, 8]), softmax([0, 2, 0, 0, 0])
    assert paper.tolist() == pytest.approx([a + b for a, b in zip(row3[:3], row4[:3])], rel=1e-5)  # summed votes
    row3, row4 = softmax([4, 0, 0]), softmax([0, 2, 0])
    assert ref.tolist() == pytest.approx([(a + b) / 2 for a, b in zip(row3, row4)], rel=1e-5)  # window mean
    assert paper.argmax().item() == 1 and ref.argmax().item() == 0


def unit2(cos):
    return [cos, math.sqrt(1 - cos * cos)]


def test_rkv_reference_redundancy_by_hand():
    """Three 2-D keys: cos(k0, k1) = 0.8, cos(k1, k2) = 0.6, cos(k0, k2) = 0; threshold 0.5.

    reference: each row zeroes its newest above-threshold entry (row 0: j=1, row 1: j=2, row 2: j=1), leaving only
    S[1, 0] = 0.8: column means [0.8/3, 0, 0]. paper: key j is penalized by NEWER similar keys only: key 0 by key 1
    (0.8), key 1 by key 2 (0.6): [0.8/3, 0.6/3, 0].
    """
    keys = torch.tensor([[[1.0, 0.0], unit2(0.8), [0.0, 1.0]]])
    positions = torch.arange(3).unsqueeze(0)
    ref = rkv_reference_redundancy(keys, positions, 0.5)
    assert ref[0].tolist() == pytest.approx(softmax([0.8 / 3, 0, 0]), rel=1e-5)
    assert rkv_redundancy(keys, positions, 0.5)[0].tolist() == pytest.approx(softmax([0.8 / 3, 0.6 / 3, 0]), rel=1e-5)


def test_rkv_reference_redundancy_counts_cosines_below_the_threshold():
    """cos(k0, k1) = 0.3 < 0.5: the paper variant sees no redundancy; the reference averages the raw cosine of row 0
    and, finding no similar entry in row 1, zeroes that row's oldest entry (its index arithmetic's fallback)."""
    keys = torch.tensor([[[1.0, 0.0], unit2(0.3)]])
    positions = torch.arange(2).unsqueeze(0)
    assert rkv_reference_redundancy(keys, positions, 0.5)[0].tolist() == pytest.approx(softmax([0, 0.15]), rel=1e-5)
    assert rkv_redundancy(keys, positions, 0.5)[0].tolist() == pytest.approx([0.5, 0.5])


def test_rkv_reference_redundancy_follows_logical_order_not_slots():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 12, 8, generator=g) + 1.0  # a shared offset: many cosines above 0.5
    positions = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(2)])
    order = positions.argsort(dim=-1)
    sorted_keys = keys.gather(1, order[..., None].expand_as(keys))
    in_order = rkv_reference_redundancy(sorted_keys, positions.gather(1, order), 0.5)
    shuffled = rkv_reference_redundancy(keys, positions, 0.5)
    assert torch.allclose(shuffled.gather(1, order), in_order, atol=1e-7)


def test_rkv_variants_share_the_importance_and_differ_in_redundancy():
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(2, 40, 16, generator=g) + 0.8, torch.randn(4, 8, 16, generator=g)
    positions = torch.arange(40).expand(2, 40)
    only_importance = [score_tokens(cfg_for("rkv", v, budget=16, window=8, mix_lambda=1.0), keys, queries, positions)
                       for v in ("paper", "reference")]
    assert torch.equal(*only_importance)
    paper, ref = (score_tokens(cfg_for("rkv", v, budget=16, window=8), keys, queries, positions)
                  for v in ("paper", "reference"))
    assert not torch.allclose(paper, ref)


def test_shared_sets_sum_raw_scores_under_reference():
    """Two heads, candidates [0, 10, 5] and [1, 0, 0.9]: normalized rows [0, 1, .5] + [1, 0, .9] pick candidate 2;
    raw sums [1, 10, 5.9] pick candidate 1 (the reference's `final_score.sum(dim=1)`)."""
    scores = torch.tensor([[0.0, 10.0, 5.0, 0.0], [1.0, 0.0, 0.9, 0.0]])  # the last entry is the window
    assert KVPolicyConfig().normalize_sums and not KVPolicyConfig(variant="reference").normalize_sums
    assert select_keep(scores, 2, 1, shared=True).tolist() == [[2, 3], [2, 3]]
    assert select_keep(scores, 2, 1, shared=True, normalize=False).tolist() == [[1, 3], [1, 3]]


def test_paper_is_the_default_and_streaming_has_one_scoring():
    assert KVPolicyConfig().variant == "paper" and load_config([]).rollout.kv.variant == "paper"
    assert set(REFERENCE_POLICIES) == {"rkv", "snapkv"} and POLICIES["rkv"] is not REFERENCE_POLICIES["rkv"]
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(2, 30, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    positions = torch.arange(30).expand(2, 30)
    a, b = (score_tokens(cfg_for("streaming", v, budget=10, window=4, sinks=2), keys, queries, positions)
            for v in ("paper", "reference"))
    assert torch.equal(a, b)


def test_bad_variants_are_refused():
    with pytest.raises(ValueError, match=r"rollout.kv.variant=official: must be one of paper, reference"):
        KVPolicyConfig(algorithm="rkv", variant="official")
    with pytest.raises(ValueError, match="needs the policy registered first"):
        register_policy("h2o", variant="reference")(lambda *a: None)
    with pytest.raises(ValueError, match="needs the policy registered first"):
        register_policy("rkv", variant="reference")(lambda *a: None)  # already has one
    with pytest.raises(ValueError, match="variant 'official'"):
        register_policy("h2o", variant="official")


def test_the_config_key_reaches_the_policy_config():
    assert load_config(["rollout.kv.algorithm=rkv", "rollout.kv.variant=reference"]).rollout.kv.variant == "reference"


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the reference scorings, the functions themselves still run."""
    calls = []
    for name, fn in list(REFERENCE_POLICIES.items()):
        def counted(*args, _fn=fn, _name=name):
            calls.append(_name)
            return _fn(*args)
        monkeypatch.setitem(REFERENCE_POLICIES, name, counted)
    return calls


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_the_native_engine_scores_with_the_variant(algorithm, spy):
    kv = KVPolicyConfig(algorithm=algorithm, budget=12, window=4, divide_length=4, kernel=3, share="layer",
                        variant="reference")
    engine = NativeEngine(tiny_model("llama"), num_slots=512, eos_token_ids=[], kv=kv)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
    gens = engine.generate([GenerationRequest([1, 2, 3, 4, 5], params)])
    assert gens[0].kv.compressions >= 2 and set(spy) == {algorithm}


def test_the_sglang_compactor_selects_with_the_variant(spy):
    layers, h_kv, h_q, dim, n, keep = 2, 2, 4, 8, 20, 12
    cfg = KVPolicyConfig(algorithm="rkv", budget=keep, window=4, divide_length=4, share="layer", variant="reference")
    comp = KVCompactor(cfg, layers, h_kv, rows=2, device="cpu")
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(64, h_kv, dim, generator=g) + 0.5 for _ in range(layers)]
    v = [torch.randn(64, h_kv, dim, generator=g) for _ in range(layers)]
    q = torch.randn(layers, n, h_q, dim, generator=g)
    comp.plan_capture([0], [n], [True])
    for layer in range(layers):
        comp.capture(layer, q[layer])
    slots = torch.arange(n) + 3
    k0 = [x.clone() for x in k]
    assert comp.on_token(0, "r", prompt_len=4, outputs=1, held=n, newline=False)
    done = comp.compact(0, slots, k, v, outputs=1)
    assert set(spy) == {"rkv"}
    positions = torch.arange(n).expand(h_kv, n)
    for layer in range(layers):
        scores = score_tokens(cfg, k0[layer][slots].transpose(0, 1), q[layer, -4:].transpose(0, 1), positions)
        assert done.kept_positions[layer].tolist() == select_keep(scores, keep, 4, True, normalize=False).tolist()
