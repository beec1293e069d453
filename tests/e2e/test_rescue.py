"""The rescue of rejected samples (`algo.correction.rescue=dense`) in real one-process runs of a tiny model: a KV
budget small enough, and a geometric-mean bound tight enough, that the correction rejects sparse samples every step;
they are rolled out again densely, every group stays whole, the correction rejects fewer afterwards, and a run
stopped after step 2 and resumed logs the same step 3 as the uninterrupted one."""
from __future__ import annotations

import json

import pytest

from sparserl.trainer.metric_names import find
from tests.e2e.test_dynamic_sampling import PARITY_ENV
from tests.e2e.test_faults import TIMING
from tests.e2e.test_trainer import read_metrics, tiny_args, trainer, write_data

N = 2


def _args(ckpt, data, env, out, **extra):
    return tiny_args(ckpt, data, env, out, steps=3, **{
        "+preset": "sparse_rl", "rollout.kv.budget": 4, "rollout.kv.window": 2, "rollout.kv.divide_length": 2,
        "rollout.kv.kernel": 3, "rollout.kv.compress_prompt": "true", "rollout.max_new_tokens": 8,
        "algo.correction.geo_low": 0.999, "algo.correction.rescue": "dense", "trainer.log_samples": 8, **extra})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("rescue")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    env = root / "env.py"
    env.write_text(PARITY_ENV)
    return write_data(root / "train.jsonl", rows), env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rejected_samples_are_rolled_out_again_densely_and_resume_is_exact(tiny_checkpoint, task, tmp_path):
    data, env = task
    full, parted = tmp_path / "full", tmp_path / "parted"
    res = trainer(_args(tiny_checkpoint, data, env, full))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "old log-probs: a separate forward pass (algo.correction.rescue=dense" in res.stdout + res.stderr
    rows = read_metrics(full)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert m["rescue/seqs"] > 0, m
        assert m["rescue/frac"] == m["rescue/seqs"] / 8
        assert m["rescue/rejected_before_frac"] >= m["rescue/frac"]
        assert m["correction/rejected_seq_frac"] < m["rescue/rejected_before_frac"]
        assert 0 <= m["rescue/reward_mean"] <= 1 and m["perf/rescue_s"] > 0
    assert not sorted({k for m in rows for k in m if find(k) is None})

    for m in rows:  # the trained batch, sample by sample: whole groups in order, the redraws dense and kept
        records = [json.loads(line) for line in (full / "samples" / f"step_{m['step']}.jsonl").read_text().splitlines()]
        assert [r["group"] for r in records] == [k // N for k in range(8)]
        assert all(records[k]["prompt"] == records[k + 1]["prompt"] for k in range(0, 8, N))
        redrawn = [r for r in records if not r["compressed_at"]]
        assert len(redrawn) >= m["rescue/seqs"]  # a sparse sample may also have stayed uncompressed
        assert all(r["kv_retained_frac"] == 1.0 and not r["rejected"] for r in redrawn)
        assert all(abs(x) < 1e-4 for r in redrawn for x in r["tokens"]["log_xi"])

    res = trainer(_args(tiny_checkpoint, data, env, parted, **{"trainer.stop_after": 2}))
    assert res.returncode == 0, res.stderr[-3000:]
    res = trainer(_args(tiny_checkpoint, data, env, parted, **{"trainer.resume": "auto"}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout + res.stderr
    a, b = read_metrics(full)[-1], read_metrics(parted)[-1]
    assert a["step"] == b["step"] == 3
    assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == {k: v for k, v in b.items()
                                                                         if not k.startswith(TIMING)}
