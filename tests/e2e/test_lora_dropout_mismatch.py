"""A LoRA actor with adapter dropout on the default fused path: logp_old must be the old policy's (no
dropout), so a dense run measures no mismatch, with dropout as without it. The update's own forward runs with
dropout, so the trainer takes the separate pass for logp_old and says why."""
from __future__ import annotations

import pytest

from tests.e2e.test_trainer import read_metrics, side_by_side, tiny_args, trainer, write_data

LORA = {"+preset": "dense", "algo.correction.enable": "true", "actor.lora.rank": 4, "actor.lora.alpha": 16,
        "actor.lr": 1e-2, "algo.entropy_coef": 0.0}


@pytest.mark.timeout(600)
def test_a_dense_lora_run_with_dropout_measures_the_mismatch_of_one_without(tiny_checkpoint, tmp_path):
    pytest.importorskip("peft")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data, env = write_data(tmp_path / "train.jsonl", rows), tmp_path / "env.py"
    env.write_text("max_turns = 1\n\nasync def step(state, action, extra_info):\n"
                   "    r = float(len(action) % 2)\n"
                   "    return {'next_state': None, 'reward': r, 'score': r, 'done': True, 'extra_info': extra_info}\n")

    def run(name, dropout):
        out = tmp_path / name
        res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=2, **LORA, **{"actor.lora.dropout": dropout}))
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout + res.stderr, read_metrics(out)

    (log_off, plain), (log_on, dropped) = side_by_side(lambda: run("plain", 0.0), lambda: run("dropout", 0.5))
    assert "old log-probs: from the update's own forward" in log_off
    assert "old log-probs: a separate forward pass (adapter dropout (actor.lora.dropout)" in log_on
    # Step 2 samples with the weights step 1's update made; its dense pass must see what the sampler saw.
    assert plain[0]["actor/grad_norm"] > 0 and dropped[0]["actor/grad_norm"] > 0
    base = max(plain[1]["mismatch/abs_max"], 1e-6)
    assert dropped[1]["mismatch/abs_max"] <= 10 * base, (dropped[1]["mismatch/abs_max"], plain[1]["mismatch/abs_max"])
    assert abs(dropped[1]["mismatch/kl"]) <= 10 * max(abs(plain[1]["mismatch/kl"]), 1e-7)
