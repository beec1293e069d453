"""The critic and GAE (docs/training.md#ppo-with-a-critic): GAE against a direct backward recursion over each row's
model tokens (ragged rows, multi-turn gaps, a rejected row), the clipped value loss and its gradient by hand in
float64, the value statistics, the config's bad values, and a real tiny critic in one process: its packed values
equal a plain forward of its trunk and head, and a run resumed from its checkpoint (actor + critic shards, the
critic's LR schedule through the registry of saved state) continues bitwise as the uninterrupted one."""
from contextlib import nullcontext

import pytest
import torch

from sparserl.actor import checkpoint
from sparserl.actor.actor import Actor, TrainBatch
from sparserl.algo.advantages import ADV_ESTIMATORS, compute_advantages, gae_returns
from sparserl.algo.aggregation import Normalizer
from sparserl.algo.value_loss import value_loss, value_stats
from sparserl.config.fields import ConfigError
from sparserl.config.load import load_config
from sparserl.config.relations import VALUE_ESTIMATORS
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.critic import CriticStep
from sparserl.trainer.saved_state import SavedState
from sparserl.utils.errors import UserError
from tests.conftest import tiny_model

D = torch.float64


def ragged_batch(seed=0):
    """Four rows of up to 7 tokens: one turn, two turns with env tokens between (mask 0), a short one, a rejected one."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0],
                         [1, 1, 0, 0, 1, 1, 1],
                         [1, 0, 1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0]], dtype=D)
    values = torch.randn(4, 7, generator=g, dtype=D)
    tok = torch.randn(4, 7, generator=g, dtype=D) * 0.1 * mask
    rewards = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=D)  # (G=2, n=2)
    return rewards, mask, values, tok


def direct_gae(rewards, mask, values, tok, gamma, lam):
    """Textbook GAE per row over its model tokens only, in order: A_j = r_j + gamma V_{j+1} - V_j + gamma lam A_{j+1}."""
    adv = torch.zeros_like(values)
    for i in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        a_next, v_next = 0.0, 0.0
        for j in reversed(range(len(pos))):
            t = pos[j]
            r = float(tok[i, t]) + (float(rewards.reshape(-1)[i]) if j == len(pos) - 1 else 0.0)
            a = r + gamma * v_next - float(values[i, t]) + gamma * lam * a_next
            adv[i, t] = a
            a_next, v_next = a, float(values[i, t])
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.7, 0.0)])
def test_gae_matches_a_direct_backward_recursion(gamma, lam):
    rewards, mask, values, tok = ragged_batch()
    want = direct_gae(rewards, mask, values, tok, gamma, lam)
    returns = gae_returns(rewards, mask, values, tok, gamma, lam)
    assert torch.allclose(returns, (want + values) * mask, atol=1e-12, rtol=0)
    adv, _ = compute_advantages("gae", rewards, mask=mask, token_rewards=tok, values=values, gamma=gamma, lam=lam)
    on = mask > 0
    mean, std = want[on].mean(), want[on].std()  # whitened over the masked tokens, sample std
    assert torch.allclose(adv[on], (want[on] - mean) / (std + 1e-6), atol=1e-12, rtol=0)
    assert (adv[~on] == 0).all()  # env tokens and the rejected row get none


def test_gae_bootstraps_across_env_tokens_and_ignores_their_values():
    rewards, mask, values, tok = ragged_batch(1)
    moved = values.clone()
    moved[mask == 0] = 1e6  # the values of env tokens and of the rejected row do not enter
    for g, lam in ((1.0, 1.0), (0.9, 0.8)):
        a = gae_returns(rewards, mask, values, tok, g, lam)
        assert torch.equal(a, gae_returns(rewards, mask, moved, tok, g, lam))
    # gamma = lam = 1: A_t is the return from t minus V_t, whatever the other values
    ret = gae_returns(rewards, mask, values, tok, 1.0, 1.0)
    row = 1
    pos = [t for t in range(7) if mask[row, t] > 0]
    for j, t in enumerate(pos):
        tail = sum(float(tok[row, s]) for s in pos[j:]) + float(rewards.reshape(-1)[row])
        assert float(ret[row, t]) == pytest.approx(tail, abs=1e-12)


def test_gae_needs_values_and_the_registry_matches_the_config():
    rewards, mask, _, _ = ragged_batch()
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", rewards, mask=mask)
    assert sorted(VALUE_ESTIMATORS) == sorted(k for k, e in ADV_ESTIMATORS.items() if e.uses_values)


@pytest.mark.parametrize("clip", [0.3, None])
def test_value_loss_with_clipping_by_hand_gradients_included(clip):
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=D)
    old = torch.randn(2, 4, generator=g, dtype=D)
    step = torch.tensor([[0.5, -0.1, -0.9, 0.2], [0.05, 0.4, -0.35, 0.7]], dtype=D)  # the update's moves
    # Targets beyond a move past the range (the clipped error wins), behind it, and off to the side.
    ret = old + step * torch.tensor([[2.0, -1.0, 1.5, 3.0], [-2.0, 2.5, 0.5, -0.5]], dtype=D) + 0.01 * torch.randn(
        2, 4, generator=g, dtype=D)
    new = (old + step).requires_grad_(True)
    norm = Normalizer(tokens=float(mask.sum()) + 3.0, seqs=4.0)  # another micro-batch holds 3 more tokens
    loss, m = value_loss(new, old, ret, mask, norm, clip)
    loss.backward()
    total, grad, clipped = 0.0, torch.zeros_like(old), 0
    for i in range(2):
        for t in range(4):
            if mask[i, t] == 0:
                continue
            v, o, r = float(new[i, t].detach()), float(old[i, t]), float(ret[i, t])
            e1, d1 = (v - r) ** 2, 2 * (v - r)
            if clip is None:
                e, d = e1, d1
            else:
                vc = o + max(-clip, min(clip, v - o))
                e2, d2 = (vc - r) ** 2, (2 * (vc - r) if abs(v - o) < clip else 0.0)
                e, d = (e2, d2) if e2 > e1 else (e1, d1)
                clipped += e2 > e1
            total += e
            grad[i, t] = 0.5 * d / norm.tokens
    assert float(loss.detach()) == pytest.approx(0.5 * total / norm.tokens, abs=1e-14)
    assert torch.allclose(new.grad, grad, atol=1e-14, rtol=0)
    assert float(m["critic/clip_frac"]) == pytest.approx(clipped / float(mask.sum()))
    if clip is not None:
        assert clipped > 0 and (new.grad[mask > 0] == 0).any()  # some tokens pushed past the range get no gradient


def test_value_stats_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
    v = torch.tensor([[0.1, 0.4, 9.0], [0.3, -0.2, 0.5]], dtype=D)
    r = torch.tensor([[0.0, 1.0, -9.0], [0.5, 0.0, 1.0]], dtype=D)
    on = mask > 0
    want = 1 - (r[on] - v[on]).var(unbiased=False) / r[on].var(unbiased=False)
    s = value_stats(v, r, mask, lambda x: x)
    assert s["critic/explained_var"] == pytest.approx(float(want), abs=1e-12)
    assert s["critic/value_mean"] == pytest.approx(float(v[on].mean())) and s["critic/return_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("overrides, expect", [
    (["+preset=ppo", "algo.lam=-0.1"], "algo.lam=-0.1: must be in [0, 1]"),
    (["+preset=ppo", "algo.gamma=1.5"], "algo.gamma=1.5: must be in [0, 1]"),
    (["algo.adv_estimator=gae"], "critic.enable=false"),
    (["critic.enable=true"], "critic.enable=true with algo.adv_estimator=grpo"),
    (["+preset=[ppo,gspo]"], "use algo.policy_loss=gspo_token"),
    (["+preset=ppo", "critic.clip=0"], "critic.clip=0"),
])
def test_bad_values_are_one_line(overrides, expect):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_ppo_preset_composes_with_sparse_rl():
    cfg = load_config(["+preset=[ppo,sparse_rl]"])
    assert (cfg.algo.adv_estimator, cfg.critic.enable, cfg.algo.kl.mode, cfg.algo.kl.estimator) == ("gae", True, "reward", "k1")
    assert cfg.algo.correction.enable and cfg.rollout.kv.algorithm == "rkv" and cfg.algo.kl.coef > 0


# --------------------------------------------------------------------------------------- a real tiny critic
PROMPTS = [[1, 5, 7, 9, 3], [1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 10, 11, 12]]  # the first two share a prompt


def train_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lens = (6, 4, 5, 3)
    ids = [p + torch.randint(5, 120, (r,), generator=g).tolist() for p, r in zip(PROMPTS, lens)]
    mask = torch.zeros(4, 6)
    for i, r in enumerate(lens):
        mask[i, :r] = 1.0
    mask[1, 1] = 0.0  # an env token
    return TrainBatch(ids=ids, prompt_lens=[len(p) for p in PROMPTS], mask=mask, advantages=torch.zeros(4, 6))


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so that what init_distributed sets for its world of one is undone
        monkeypatch.delenv(key)
    tiny_model().save_pretrained(tmp_path / "ckpt")
    info = init_distributed("cpu")
    try:
        yield str(tmp_path / "ckpt"), ParallelDims.from_world(1, 1).build_mesh("cpu"), info.device
    finally:
        teardown()


def critic_step(path: str, mesh, device) -> CriticStep:
    cfg = load_config([f"model.path={path}", "+preset=ppo", "model.compute_dtype=float32", "critic.lr=1e-2",
                       "critic.warmup_steps=3", "actor.max_tokens_per_device=24", "critic.clip=0.2"])
    return CriticStep(cfg, path, mesh, device)


def test_packed_values_are_the_trunk_and_head_of_each_tokens_state(one_process):
    path, mesh, device = one_process
    step = critic_step(path, mesh, device)
    b = train_batch()
    step.score(b, nullcontext())
    plain = tiny_model()
    head = step.critic.model.value_head
    with torch.no_grad():
        for i, (ids, p) in enumerate(zip(b.ids, b.prompt_lens)):
            h = plain.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # (L, H)
            want = (h[p - 1: len(ids) - 1] @ head.weight.T + head.bias)[:, 0]
            assert torch.allclose(b.values[i, : len(ids) - p], want, atol=1e-5), i
            assert (b.values[i, len(ids) - p:] == 0).all()


def test_critic_resumed_from_its_checkpoint_equals_the_uninterrupted_run(one_process, tmp_path):
    path, mesh, device = one_process

    def one_step(step: CriticStep, k: int) -> dict:
        b = train_batch()
        step.score(b, nullcontext())
        b.returns = torch.randn(4, 6, generator=torch.Generator().manual_seed(k)) * b.mask
        return step.train(b, None, nullcontext())

    full = critic_step(path, mesh, device)
    logged = [one_step(full, k) for k in range(3)]
    assert all(m["critic/grad_norm"] > 0 for m in logged) and logged[2]["critic/lr"] == 1e-2  # warm-up done

    actor = Actor(path, mesh, device, dtype="float32", compute_dtype="float32")
    cut = critic_step(path, mesh, device)
    for k in range(2):
        one_step(cut, k)
    saved = SavedState()
    cut.register(saved)
    checkpoint.save(tmp_path / "out", 2, actor.model, actor.optimizer, saved.state_dict(), 0, extra=cut.checkpointed())
    ckpt = checkpoint.latest(tmp_path / "out")
    bare = checkpoint.save(tmp_path / "bare", 1, actor.model, actor.optimizer, {}, 0)  # a run without a critic
    with pytest.raises(UserError, match="holds no critic"):
        checkpoint.load(bare, actor.model, actor.optimizer, cut.checkpointed())

    resumed = critic_step(path, mesh, device)  # fresh weights, moments and schedule, all restored below
    again = SavedState()
    resumed.register(again)
    again.load_state_dict(checkpoint.load(ckpt, actor.model, actor.optimizer, resumed.checkpointed()))
    last = one_step(resumed, 2)
    assert last == logged[2]  # every metric, bitwise
    a, b = full.critic.model.state_dict(), resumed.critic.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
