"""`parallel.dp_replicate`: a 4-process GRPO step (gloo) with 2 replicas x 2 shards, its checkpoint resumed on 2
processes in one shard group (DCP reshards the replicated-and-sharded parameters), the next step finite."""
import math

from tests.e2e.test_objectives import parity_task
from tests.e2e.test_trainer import read_metrics, tiny_args, trainer


def test_a_hybrid_sharded_step_resumes_on_another_layout(tiny_checkpoint, tmp_path):
    data, env = parity_task(tmp_path)
    out = tmp_path / "run"
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=1, **{"parallel.dp_replicate": 2}), nproc=4)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dp 4 (2 replicas x 2 shards) x tp 1 x cp 1" in res.stdout + res.stderr
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=2, **{"trainer.resume": "auto"}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "saved with 4 processes, now 2" in res.stdout + res.stderr
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(v) for m in metrics for v in m.values() if isinstance(v, float))
    assert metrics[1]["actor/grad_norm"] > 0
