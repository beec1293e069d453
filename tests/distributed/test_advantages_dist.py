"""REINFORCE++'s batch whitening is over the whole batch: 2 processes (gloo, CPU), each with one group, give the
advantages one process gives the two groups, and not those of whitening each rank's share alone."""
import os
import subprocess
from pathlib import Path

import torch

from sparserl.algo.advantages import compute_advantages
from tests.launch import command
from tests.unit.test_advantages import ragged_batch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("advantages_worker.py")


def test_whitening_spans_the_data_parallel_ranks(tmp_path):
    out = tmp_path / "adv.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(command(2, str(WORKER), str(out)), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    rewards, valid, mask, token_rewards = ragged_batch()
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        whole, _ = compute_advantages(name, rewards, valid, mask=mask, token_rewards=token_rewards)
        torch.testing.assert_close(got[name], whole, rtol=1e-12, atol=1e-12)
        alone, _ = compute_advantages(name, rewards[:1], valid[:1], mask=mask[:3], token_rewards=token_rewards[:3])
        assert not torch.allclose(alone, whole[:3]), name
