"""KV policies on hand-built tensors: what each keeps, the shared-set option, and the index invariants.

Left out on purpose: model-level checks (accuracy under compression belongs to the engine and e2e tests).
"""
import itertools
import math

import pytest
import torch

from sparserl.kv import POLICIES, KVPolicyConfig, reduce_scores, register_policy, score_tokens, select_keep

ALGOS = ("rkv", "snapkv", "streaming")


def cfg_for(algorithm, **kw):
    kw.setdefault("budget", 16)
    kw.setdefault("window", 4)
    return KVPolicyConfig(algorithm=algorithm, **kw)


def orthonormal(n, dim, seed=0):
    """(n, dim) mutually orthogonal unit rows: no two keys are similar, so rkv redundancy is zero."""
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)))
    return q[:n].contiguous()


def keep(cfg, keys, queries, positions, n_keep, shared=False):
    scores = score_tokens(cfg, keys, queries, positions)
    return select_keep(scores, n_keep, cfg.window, shared)


def attended_queries(keys_h, weights, n_q_heads, n_w):
    """Queries of one KV group that point at keys_h[j] with strength weights[j]."""
    q = sum(w * keys_h[j] for j, w in weights.items())
    return q.expand(n_q_heads, n_w, -1).clone()


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("shared", [False, True])
def test_window_always_kept(algorithm, shared):
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(2, 30, 16, generator=g), torch.randn(4, 4, 16, generator=g)
    # Near-zero window keys draw no attention and look alike; they must be kept all the same.
    keys[:, -4:] *= 1e-3
    positions = torch.arange(30).expand(2, 30)
    idx = keep(cfg_for(algorithm), keys, queries, positions, n_keep=6, shared=shared)
    assert idx.shape == (2, 6)
    assert (idx[:, -4:] == torch.arange(26, 30)).all()


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_strongly_attended_keys_win(algorithm):
    n_cand, window, dim = 24, 4, 32
    keys = orthonormal(n_cand + window, dim).unsqueeze(0)  # (1, L, D)
    # GQA: 2 query heads share the single KV head; they attend most to token 10, then 3, then 17.
    queries = attended_queries(keys[0], {10: 12.0, 3: 9.0, 17: 6.0}, n_q_heads=2, n_w=window)
    positions = torch.arange(n_cand + window).unsqueeze(0)
    cfg = cfg_for(algorithm, window=window, kernel=1)
    assert keep(cfg, keys, queries, positions, n_keep=window + 1).tolist() == [[10, 24, 25, 26, 27]]
    assert keep(cfg, keys, queries, positions, n_keep=window + 2).tolist() == [[3, 10, 24, 25, 26, 27]]
    assert keep(cfg, keys, queries, positions, n_keep=window + 3).tolist() == [[3, 10, 17, 24, 25, 26, 27]]


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_max_pool_follows_logical_order_not_slots(algorithm):
    n_cand, window, dim = 24, 4, 32
    base = orthonormal(n_cand + window, dim)
    perm = torch.cat([torch.randperm(n_cand, generator=torch.Generator().manual_seed(2)), torch.arange(24, 28)])
    keys = torch.stack([base, base[perm]])  # head 1 holds the same tokens in shuffled candidate slots
    positions = torch.stack([torch.arange(28), perm])
    queries = torch.cat([attended_queries(base, {10: 12.0}, 1, window),
                         attended_queries(base, {10: 12.0}, 1, window)])
    idx = keep(cfg_for(algorithm, window=window, kernel=5), keys, queries, positions, n_keep=window + 5)
    kept_positions = positions.gather(1, idx)
    for head in range(2):  # the strong token and its two neighbours on each side, in token order
        assert sorted(kept_positions[head].tolist()) == [8, 9, 10, 11, 12, 24, 25, 26, 27]


@pytest.mark.parametrize("newest_slot", [6, 2])
def test_rkv_keeps_one_of_exact_duplicates(newest_slot):
    dim, window = 16, 4
    eye = torch.eye(dim)
    dup = eye[8]
    cand = [eye[0], eye[1], dup, eye[3], eye[4], dup, dup, eye[7]]  # slots 2, 5, 6 hold the same key
    keys = torch.stack(cand + [eye[12], eye[13], eye[14], eye[15]]).unsqueeze(0)  # (1, 12, D)
    queries = torch.zeros(1, window, dim)  # uniform attention: every candidate is equally important
    cand_pos = [0, 1, 2, 3, 4, 5, 6, 7] if newest_slot == 6 else [0, 1, 7, 3, 4, 5, 6, 2]
    positions = torch.tensor(cand_pos + [8, 9, 10, 11]).unsqueeze(0)
    older = sorted({2, 5, 6} - {newest_slot})

    cfg = cfg_for("rkv", window=window, mix_lambda=0.1)
    scores = score_tokens(cfg, keys, queries, positions)[0]
    assert scores[older[0]] < scores[0] and scores[older[1]] < scores[0]
    assert scores[newest_slot] == scores[0]  # the newest copy is as good as a distinct key
    idx = select_keep(scores.unsqueeze(0), 6 + window, window, shared=False)
    assert idx[0].tolist() == sorted(set(range(12)) - set(older))

    flat = score_tokens(cfg_for("rkv", window=window, mix_lambda=1.0), keys, queries, positions)[0]
    assert torch.equal(flat[:8], torch.full((8,), flat[0].item()))  # lambda = 1: duplicates not penalized


def test_streaming_keeps_sinks_and_recent():
    window, n_cand = 4, 16
    pos0 = torch.tensor([0, 1, 5, 6, 7, 9, 12, 13, 20, 21, 22, 30, 31, 33, 35, 36, 40, 41, 42, 43])  # gaps
    perm = torch.randperm(n_cand, generator=torch.Generator().manual_seed(3))
    pos1 = torch.cat([torch.arange(n_cand)[perm], torch.arange(16, 20)])  # shuffled candidate slots
    positions = torch.stack([pos0, pos1])
    keys, queries = torch.randn(2, 20, 8), torch.randn(2, 4, 8)
    idx = keep(cfg_for("streaming", window=window, sinks=2), keys, queries, positions, n_keep=12)
    kept = positions.gather(1, idx)
    assert sorted(kept[0].tolist()) == [0, 1, 22, 30, 31, 33, 35, 36, 40, 41, 42, 43]
    assert sorted(kept[1].tolist()) == [0, 1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_per_head_sets_differ_and_shared_sets_agree(algorithm):
    window, dim = 4, 32
    base = orthonormal(24, dim)
    keys = torch.stack([base, base])  # (2, 24, D)
    positions = torch.arange(24).expand(2, 24)
    # GQA 4 query heads -> 2 KV heads: group 0 looks at token 5, group 1 at token 15.
    queries = torch.cat([attended_queries(base, {5: 12.0}, 2, window), attended_queries(base, {15: 12.0}, 2, window)])
    cfg = cfg_for(algorithm, window=window, kernel=1)
    win = [20, 21, 22, 23]
    assert keep(cfg, keys, queries, positions, window + 1).tolist() == [[5] + win, [15] + win]
    assert keep(cfg, keys, queries, positions, window + 2, shared=True).tolist() == [[5, 15] + win] * 2
    one = keep(cfg, keys, queries, positions, window + 1, shared=True)
    assert torch.equal(one[0], one[1]) and one[0, 0].item() in (5, 15)


def test_shared_selection_weighs_heads_equally():
    # Raw sums would pick slot 1 (head 0's large scale dominates); normalized per head, slot 2 wins.
    scores = torch.tensor([[0.0, 100.0, 50.0, 0.0], [1.0, 0.0, 0.9, 0.0]])
    assert select_keep(scores, 2, window=1, shared=True).tolist() == [[2, 3], [2, 3]]
    assert select_keep(scores, 2, window=1, shared=False).tolist() == [[1, 3], [0, 3]]


def test_reduce_scores_normalizes_each_layer():
    a = torch.tensor([[0.0, 10.0, 5.0]])
    b = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    total = reduce_scores([a, b])
    assert total.shape == (2, 3)
    torch.testing.assert_close(total, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.5]]))
    with pytest.raises(ValueError, match="at least one layer"):
        reduce_scores([])


def test_rkv_scores_match_hand_computation():
    # 3 candidates + 1 window key, D = 2; k0 and k1 are equal, k2 orthogonal, the window key opposite to k0.
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    queries = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]])  # 2 query heads in the one KV group, window 1
    lam = 0.3
    cfg = cfg_for("rkv", window=1, budget=3, kernel=1, mix_lambda=lam)
    scores = score_tokens(cfg, keys, queries, torch.arange(4)[None])[0]
    r2 = math.sqrt(2)
    logits = [max(2 / r2, 0.0), max(2 / r2, 0.0), max(0.0, 1 / r2)]  # GQA max before the softmax
    importance = [math.exp(x) / sum(math.exp(y) for y in logits) for x in logits]
    # Only k0 has a newer near-duplicate (k1, cos 1); mean over the 4 rows -> 0.25, then softmax over all 4.
    z = math.exp(0.25) + 3
    redundancy = [math.exp(0.25) / z, 1 / z, 1 / z]
    expected = [lam * i - (1 - lam) * r for i, r in zip(importance, redundancy)]
    torch.testing.assert_close(scores, torch.tensor(expected + [max(expected)]))


def test_snapkv_scores_match_hand_computation():
    # 2 candidates + window 2; the last window key is huge, and the first window query must not see it.
    keys = torch.tensor([[[0.0], [0.0], [0.0], [10.0]]])
    queries = torch.ones(1, 2, 1)
    cfg = cfg_for("snapkv", window=2, budget=3, kernel=1)
    scores = score_tokens(cfg, keys, queries, torch.arange(4)[None])[0]
    vote = 1 / 3 + 1 / (3 + math.exp(10))  # query 0 sees slots 0..2 uniformly; query 1 sees all four
    torch.testing.assert_close(scores, torch.tensor([vote] * 4))


@pytest.mark.parametrize("algorithm", ALGOS)
def test_indices_valid_over_random_shapes(algorithm):
    g = torch.Generator().manual_seed(4)
    heads, lengths, windows = [(2, 2), (4, 2), (4, 1)], [1, 3, 5, 17, 40], [1, 4, 8]
    dtypes = [torch.float32, torch.bfloat16]
    for (n_q, n_kv), n_cached, window, dtype in itertools.product(heads, lengths, windows, dtypes):
        n_win = min(window, n_cached)
        keys = torch.randn(n_kv, n_cached, 8, generator=g).to(dtype)
        queries = torch.randn(n_q, n_win, 8, generator=g).to(dtype)
        positions = torch.stack([torch.randperm(100, generator=g)[:n_cached].sort().values for _ in range(n_kv)])
        scores = score_tokens(cfg_for(algorithm, window=window, budget=window + 2, sinks=1), keys, queries, positions)
        assert scores.dtype == torch.float32 and scores.shape == (n_kv, n_cached) and scores.isfinite().all()
        n_keeps = {n_win, n_win + 1, (n_win + n_cached) // 2, n_cached - 1, n_cached + 2}
        n_keeps = sorted(k for k in n_keeps if k >= n_win)
        for n_keep, shared in itertools.product(n_keeps, [False, True]):
            idx = select_keep(scores, n_keep, window, shared)
            assert idx.dtype == torch.long and idx.shape == (n_kv, min(n_keep, n_cached))
            assert (idx[:, 1:] > idx[:, :-1]).all(), "rows sorted ascending and unique"
            assert idx.min() >= 0 and idx.max() < n_cached
            assert (idx[:, idx.shape[1] - n_win:] == torch.arange(n_cached - n_win, n_cached)).all()
            if shared:
                assert (idx == idx[:1]).all()


def test_n_keep_at_least_length_returns_everything():
    scores = torch.randn(3, 7)
    for n_keep in (7, 8, 100):
        assert select_keep(scores, n_keep, 4, shared=False).tolist() == [list(range(7))] * 3
    with pytest.raises(ValueError, match="n_keep"):
        select_keep(scores, 3, 4, shared=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(algorithm="h2o"), "algorithm"),
        (dict(algorithm="rkv", budget=8, window=8), "budget"),
        (dict(algorithm="rkv", window=0), "window"),
        (dict(algorithm="rkv", kernel=6), "kernel"),
        (dict(algorithm="rkv", divide_method="paragraph"), "divide_method"),
        (dict(algorithm="rkv", divide_length=0), "divide_length"),
        (dict(algorithm="rkv", mix_lambda=1.5), "mix_lambda"),
        (dict(algorithm="rkv", share="group"), "share"),
        (dict(algorithm="streaming", budget=10, window=8, sinks=3), "sinks"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^rollout.kv.{field}="):  # the config key, worded as on the command line
        KVPolicyConfig(**kwargs)


def test_unknown_algorithm_lists_valid_names_and_none_cannot_score():
    with pytest.raises(ValueError, match="must be one of none, rkv, snapkv, streaming"):
        KVPolicyConfig(algorithm="h2o")
    with pytest.raises(ValueError, match="'none' keeps the dense cache"):
        score_tokens(KVPolicyConfig(), torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.arange(4)[None])


def test_score_tokens_rejects_bad_shapes():
    cfg, keys, pos = cfg_for("rkv"), torch.randn(2, 10, 8), torch.arange(10).expand(2, 10)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        score_tokens(cfg, keys, torch.randn(3, 4, 8), pos)
    with pytest.raises(ValueError, match="window queries"):
        score_tokens(cfg, keys, torch.randn(2, 5, 8), pos)
    with pytest.raises(ValueError, match="positions"):
        score_tokens(cfg, keys, torch.randn(2, 4, 8), pos[:1])


def test_register_policy_adds_a_user_policy():
    @register_policy("oldest_first")
    def oldest_first(cfg, keys, queries, positions):
        n_cand = keys.shape[1] - min(cfg.window, keys.shape[1])
        return -positions[:, :n_cand].float()

    try:
        cfg = KVPolicyConfig(algorithm="oldest_first", budget=4, window=2)
        idx = keep(cfg, torch.randn(1, 8, 4), torch.randn(1, 2, 4), torch.arange(8)[None], n_keep=4)
        assert idx.tolist() == [[0, 1, 6, 7]]
        with pytest.raises(ValueError, match="already taken"):
            register_policy("rkv")(oldest_first)
    finally:
        POLICIES.pop("oldest_first")
