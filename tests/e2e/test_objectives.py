"""Tiny 2-process runs of the objectives beyond GRPO + PPO (docs/training.md#objectives): 2 steps each, every logged
metric finite and a gradient. The fast case is GSPO over REINFORCE++ advantages with the Sparse-RL correction
applied (R-KV rollouts that compress, per-token advantages whitened over both ranks, the correction's weights as a
per-sequence geometric mean); the others (RLOO, REINFORCE++-baseline and REINFORCE++ with the KL in the reward under
GSPO-token, without an entropy bonus so that zero-advantage sequences skip backward) are `slow`, each 18-20 s on the
2-core CI machine (the fast case 25 s). PPO with a critic under the correction (`+preset=[ppo,sparse_rl]`: GAE over the
critic's values, the k1 KL in the reward, the critic trained after the actor) is the second fast case: its critic/
metrics are logged and the critic learns between the steps."""
import math

import pytest

from tests.e2e.test_trainer import read_metrics, tiny_args, trainer, write_data

# A reward the tiny random model earns about half the time (the parity of its answer's characters), so groups differ.
PARITY_ENV = '''
max_turns = 1

async def step(state, action, extra_info):
    r = float(sum(map(ord, action)) % 2)
    return {"next_state": None, "reward": r, "score": r, "done": True, "extra_info": extra_info}
'''

SPARSE = {"+preset": "[gspo,sparse_rl]", "rollout.kv.budget": 8, "rollout.kv.window": 2, "rollout.kv.divide_length": 4,
          "rollout.max_new_tokens": 16}
KL_REWARD = {"algo.kl.coef": 0.05, "algo.kl.estimator": "k1", "algo.kl.mode": "reward"}
CASES = {
    "gspo_reinforce_pp_sparse": {**SPARSE, "algo.adv_estimator": "reinforce_pp"},
    "rloo": {"+preset": "rloo"},
    "reinforce_pp_baseline": {"algo.adv_estimator": "reinforce_pp_baseline", **KL_REWARD},
    "reinforce_pp_kl_gspo_token": {"algo.adv_estimator": "reinforce_pp", "algo.policy_loss": "gspo_token",
                                   "algo.clip_low": 3e-4, "algo.clip_high": 4e-4, "algo.entropy_coef": 0, **KL_REWARD},
    # PPO with a critic under the Sparse-RL correction: GAE over the critic's values, the k1 KL in the reward.
    "ppo_sparse": {**SPARSE, "+preset": "[ppo,sparse_rl]", "critic.lr": 1e-3, "critic.warmup_steps": 0},
}
FAST = ("gspo_reinforce_pp_sparse", "ppo_sparse")


def parity_task(folder):
    """Four addition prompts (a data file) and the parity env (a module file) in `folder`: (data path, env path)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = write_data(folder / "train.jsonl", rows)
    env = folder / "env.py"
    env.write_text(PARITY_ENV)
    return data, env


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c in FAST else [pytest.mark.slow]) for c in CASES])
def test_two_process_run_is_finite(case, tiny_checkpoint, tmp_path):
    data, env = parity_task(tmp_path)
    out = tmp_path / "run"
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, **{"rollout.n": 4, **CASES[case]}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert m["actor/grad_norm"] > 0
    assert any(m["adv/abs_max"] > 0 for m in metrics)  # rank 0's two groups of 4 samples tie now and then
    if case.endswith("sparse"):
        assert sum(m["kv/compressions"] for m in metrics) > 0  # the sampler was sparse
        assert all("correction/rejected_seq_frac" in m for m in metrics)
        assert "old log-probs: a separate forward pass" in res.stdout + res.stderr  # the rejections come before GAE
    if case == "gspo_reinforce_pp_sparse":
        assert "a separate forward pass (algo.adv_estimator=reinforce_pp with the correction applied" in res.stdout + res.stderr
    if case == "ppo_sparse":  # the critic trained after the actor, on the same batch, and its values fed GAE
        for m in metrics:
            assert m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0 and m["critic/explained_var"] <= 1
            assert "reward/kl_penalty" in m and m["perf/critic_update_s"] > 0 and m["perf/critic_values_s"] > 0
        assert metrics[1]["critic/value_mean"] != metrics[0]["critic/value_mean"]  # it learned between the steps
    if "kl" in case or case == "reinforce_pp_baseline":
        assert all(m["reward/kl_penalty"] != 0 for m in metrics[1:])  # the policy moved away from the reference
    if case == "reinforce_pp_kl_gspo_token":  # per-token advantages through the skip of zero-advantage sequences
        assert "zero-advantage sequences: forward without autograd" in res.stdout + res.stderr
        assert all("actor/no_grad_seq_frac" in m for m in metrics)
