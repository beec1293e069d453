"""Logged samples (`trainer.log_samples`, sparserl/trainer/samples.py) from a real training step in a child process:
the records' per-token fields are the tensors the loss received, on the separate-pass and the fused path
(the 2-process case, where `balance_ranks` moves logged rows to the other rank, is
tests/distributed/test_samples_dist.py; bounds and resume are tests/unit/test_samples_log.py)."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "samples_worker.py"


def run_step(ckpt, out: Path, path: str, nproc: int = 1, *extra: str) -> tuple[list[dict], dict]:
    """Records of rank 0 and, per (rank, row) of rank 0's rollout, what the loss received for that row."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    args = [str(WORKER), str(ckpt), str(out), path, *extra]
    cmd = command(nproc, *args)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "samples" / "step_1.jsonl").read_text().splitlines()]
    saved = [torch.load(out / f"loss_{r}.pt") for r in range(nproc)]
    seen = {}
    for rank, s in enumerate(saved):
        seen.update({origin: (rank, row) for origin, row in s["seen"].items()})
    return records, {"seen": seen, "norm_factor": saved[0]["norm_factor"], "fused": saved[0]["fused"],
                     "compressions": saved[0]["compressions"]}


def check_records_match_loss(records: list[dict], loss: dict) -> set[int]:
    """Every record's per-token fields against the loss's tensors; returns the ranks that trained rank 0's rows."""
    assert records and len(records) == len(loss["compressions"])  # log_samples=64: every sequence of rank 0
    trained_on = set()
    for rec in records:
        rank, seen = loss["seen"][(0, rec["index"])]
        trained_on.add(rank)
        tok, n = rec["tokens"], rec["num_tokens"]
        assert rec["tokens_dropped"] == 0 and all(len(v) == n for v in tok.values())
        close = dict(rel=1e-5, abs=1e-6)  # records keep 6 significant digits
        assert tok["logp_old"] == pytest.approx(seen["logp_old"][:n].tolist(), **close)
        assert tok["logp_sparse"] == pytest.approx(seen["logp_sparse"][:n].tolist(), **close)
        expect_xi = (seen["logp_old"][:n] - seen["logp_sparse"][:n]).clamp(-20, 20) * torch.tensor(tok["loss_mask"])
        assert tok["log_xi"] == pytest.approx(expect_xi.tolist(), rel=1e-5, abs=2e-6)
        assert rec["advantage"] == pytest.approx(seen["advantage"], **close)
        # The flags are exactly the loss mask: a model token, not masked by token_low/high, sequence not rejected.
        kept = [int(m and not x and not rec["rejected"]) for m, x in zip(tok["loss_mask"], tok["masked"])]
        assert kept == (seen["mask"][:n] > 0).int().tolist()
        # Weights on kept tokens: normalized in the batch (separate pass) or before the gradient scale (fused).
        scale = loss["norm_factor"] if loss["fused"] else 1.0
        got = [w * scale for w, k in zip(tok["weight"], kept) if k]
        assert got == pytest.approx([w for w, k in zip(seen["weights"][:n].tolist(), kept) if k], rel=1e-5)
        # Compression points: the prompt is over the budget, so at the first decode step, then every 8 tokens.
        at = rec["compressed_at"]
        assert at[0] == 1 and all(b - a == 8 for a, b in zip(at, at[1:])) and at[-1] < n
        assert len(at) == loss["compressions"][rec["index"]]
        assert "".join(tok["text"]) == rec["response"]
    by_index = {r["index"]: r for r in records}
    # The pushed-off sampler log-probs: sequence 1 vetoed at token 2, token 0 of 1 masked high, token 3 of 2 low.
    assert by_index[1]["vetoed"] and by_index[1]["rejected"] and by_index[1]["tokens"]["veto"][2] == 1
    assert by_index[2]["tokens"]["masked"][0] == 1 and by_index[2]["tokens"]["log_xi"][0] == pytest.approx(1.0, abs=0.1)
    assert by_index[3]["tokens"]["masked"][3] == 1 and by_index[3]["tokens"]["log_xi"][3] == pytest.approx(-1.0, abs=0.1)
    assert sum(r["rejected"] for r in records) >= 1 and not all(r["rejected"] for r in records)
    # Compression alone moved the sampler's log-probs (the mismatch the viewer colours is real).
    assert max(abs(x) for r in records if not r["rejected"] for x in r["tokens"]["log_xi"]) > 1e-4
    return trained_on


@pytest.mark.parametrize("path", ["fused", "separate"])
def test_records_are_what_the_loss_saw(tiny_checkpoint, tmp_path, path):
    records, loss = run_step(tiny_checkpoint, tmp_path, path)
    assert check_records_match_loss(records, loss) == {0}
