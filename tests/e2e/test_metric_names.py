"""Every key a real training run writes to metrics.jsonl is in the metric registry (sparserl/trainer/metric_names.py,
rendered as docs/metrics.md).

One tiny run (one step, 2 prompts x 2 samples, ~30 s on 2 CPU cores) turns on what adds metrics: R-KV rollouts with
the Sparse-RL correction, a reference model (KL in the loss), several optimizer steps per rollout (the separate
old-log-prob pass), the dual clip, a dense re-score of the KV mismatch, and evaluation at step 0 and after the step.
Settings that only other hardware or services reach (SGLang's pool counters, OpenReward envs, 2+ data-parallel
ranks, the KL in the reward) are held to the registry through the source by tests/unit/test_metric_names.py.
"""
from __future__ import annotations

import pytest

from sparserl.trainer.metric_names import find
from tests.e2e.test_trainer import read_metrics, trainer

STEP_KEYS = {"reward/mean", "mismatch/kl", "correction/rejected_seq_frac", "kv/compressions", "actor/kl",
             "actor/dual_clip_frac", "perf/old_logprobs_s", "perf/ref_logprobs_s", "mem/update_peak_gb",
             "rollout/kv_mismatch_kl", "eval/gsm8k/pass@2", "eval/gsm8k/maj@2"}


@pytest.mark.timeout(300)
def test_every_logged_key_is_documented(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    args = {"model.path": tiny_checkpoint, "model.compute_dtype": "float32", "rollout.dtype": "float32",
            "env.path": "envs/arithmetic.py", "data.num_generated": 16, "trainer.output_dir": out,
            "trainer.total_steps": 1, "trainer.prompts_per_step": 2, "trainer.export_hf": "false",
            "rollout.n": 2, "rollout.max_new_tokens": 16, "actor.max_tokens_per_device": 256,
            "+preset": "sparse_rl", "rollout.kv.budget": 8, "rollout.kv.window": 2, "rollout.kv.divide_length": 4,
            "rollout.rescore_seqs": 1, "algo.kl.coef": 0.01, "algo.dual_clip": 3, "algo.entropy_coef": 0.01,
            "actor.updates_per_rollout": 2, "trainer.eval_every": 1, "eval.datasets": "[gsm8k]", "eval.limit": 2,
            "eval.n": 2, "eval.k": "[1,2]", "eval.temperature": 1.0, "eval.max_new_tokens": 8}
    res = trainer([f"{k}={v}" for k, v in args.items()])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]  # the evaluation before training, then the step
    missing = STEP_KEYS - set(rows[1])
    assert not missing, f"the run did not log {sorted(missing)}: it no longer covers what it should"
    undocumented = sorted({k for r in rows for k in r if find(k) is None})
    assert not undocumented, ("metrics.jsonl keys missing from sparserl/trainer/metric_names.py (add them, then run "
                              f"python scripts/gen_reference.py): {undocumented}")
