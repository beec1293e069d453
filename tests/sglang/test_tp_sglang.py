"""The trainer with rollout.engine=sglang and parallel.tp=2 on 2 processes: one SGLang engine (tp_size 2, started
by rank 0) serves the TP group; rank 0 runs the env loop and hands its samples to rank 1 (parallel.ReplicaGroup).

The env module of tests/e2e/test_tp_rollout.py pays other rewards on odd ranks and logs its calls per rank:
only rank 0 may call it, in training and in the evaluation during training. The fp32 actor's TP recompute of
the sampled tokens must match the engine's log-probs on both steps: the TP forward sums partial results over
both ranks, so a peer holding other tokens would spoil rank 0's log-probs too. A peer's engine refuses to
generate (it has no engine; it used to wait for the owner's generations on the default process group).

SGLang's CPU build binds one rank per NUMA node unless SGLANG_CPU_OMP_THREADS_BIND says otherwise; the test
gives each of its two TP workers one core.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_tp_rollout import RANK_ENV, env_calls
from tests.sglang.conftest import close_hosts
from tests.sglang.host import HAVE_SGLANG, ROOT, SKIP_REASON

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)


@pytest.fixture(autouse=True, scope="module")
def _free_the_machine():
    close_hosts()  # the engine hosts of the other modules would compete for the two cores and memory


def test_a_peer_engine_does_not_generate(tiny_checkpoint):
    from sparserl.engines.sglang.engine import SGLangEngine, SGLangOptions, TPGroup
    from sparserl.engines.types import GenerationRequest, SamplingParams

    peer = SGLangEngine(str(tiny_checkpoint), SGLangOptions(device="cpu"), group=TPGroup.of_rank(1, 2))
    assert peer._engine is None  # no SGLang start on a peer
    with pytest.raises(RuntimeError, match="tensor-parallel peer of rank 0"):
        peer.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=2))])


@pytest.mark.slow
def test_tp2_engine_serves_the_group_and_rank0_alone_runs_the_env(tiny_checkpoint, tmp_path):
    env_path, calls, out = tmp_path / "rank_env.py", tmp_path / "calls", tmp_path / "run"
    env_path.write_text(RANK_ENV)
    calls.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"Count to {k}."}], "answer": str(k)} for k in range(1, 5)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"rollout.engine": "sglang", "logger.progress": "false", "model.path": tiny_checkpoint,
            "model.compute_dtype": "float32", "rollout.dtype": "float32", "data.train_path": data, "env.path": env_path,
            "env.max_turns": 2, "trainer.output_dir": out, "trainer.total_steps": 2, "trainer.prompts_per_step": 4,
            "rollout.n": 2, "rollout.max_new_tokens": 6, "rollout.stop_strings": "[e]", "actor.lr": 1e-3,
            "algo.entropy_coef": 0.01, "parallel.tp": 2, "trainer.export_hf": "false", "trainer.eval_every": 2,
            "eval.datasets": f"[{{name:probe,path:{data},env:{env_path}}}]", "eval.n": 1, "eval.max_new_tokens": 4}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0",
           "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "TP_ENV_LOG": str(calls)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "sparserl.trainer.grpo", *[f"{k}={v}" for k, v in args.items()]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    seen = env_calls(calls)
    assert list(seen) == ["rank0"], f"a TP peer ran the env itself: {sorted(seen)}"
    assert any('"turn": 2' in c for c in seen["rank0"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/probe/avg@1" in rows[0] and "eval/probe/avg@1" in rows[2]
    for r in rows[1:]:
        assert r["mismatch/abs_max"] < 1e-4, r
        assert r["env/turns_mean"] > 1 and r["actor/grad_norm"] > 0 and r["response/len_mean"] > 0
