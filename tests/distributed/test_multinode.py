"""Two torchrun "nodes" on this machine (one process each, static rendezvous) train the tiny model for two steps:
the same launch line as examples/multinode.sh, with 127.0.0.1 as the master address."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_two_steps(tiny_checkpoint, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = {"model.path": tiny_checkpoint, "model.compute_dtype": "float32", "rollout.dtype": "float32",
            "data.train_path": data, "env.path": ROOT / "envs" / "arithmetic.py", "trainer.output_dir": out,
            "trainer.total_steps": 2, "trainer.prompts_per_step": 4, "rollout.n": 2, "rollout.max_new_tokens": 8,
            "actor.lr": 1e-3, "actor.max_tokens_per_device": 256, "parallel.device": "cpu",
            "algo.entropy_coef": 0.01}  # entropy: a gradient even when every reward ties
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
               "--rdzv-backend=static", "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "sparserl.trainer.grpo", *[f"{k}={v}" for k, v in args.items()]]
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=150)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node_rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"node {node_rank}:\n{stderr[-3000:]}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    # One world of two: only global rank 0 (node 0) logs; a node that started a world of its own would log too.
    assert "output:" in results[0][1] and "output:" not in results[1][1], (results[0][1][-500:], results[1][1][-500:])
    assert (out / "hf" / "config.json").exists()
