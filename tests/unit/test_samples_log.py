"""Logged samples (`trainer.log_samples`, sparserl/trainer/samples.py): the records' per-token fields are the
tensors the loss received, on the separate-pass and the single-update path (the 2-process case, where
`balance_ranks` moves logged rows to the other rank, is tests/distributed/test_samples_dist.py); bounds and resume."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from sparserl.algo.correction_config import CorrectionConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.samples import MAX_RESPONSE_TOKENS, LoggedRow, SampleLog, build_record, pick_rows
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "samples_worker.py"


def run_step(ckpt, out: Path, path: str, nproc: int = 1) -> tuple[list[dict], dict]:
    """Records of rank 0 and, per (rank, row) of rank 0's rollout, what the loss received for that row."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    args = [str(WORKER), str(ckpt), str(out), path]
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


def test_pick_rows_spreads_over_groups():
    assert pick_rows(32, 4) == [0, 8, 16, 24]
    assert pick_rows(3, 4) == [0, 1, 2]
    assert pick_rows(10, 0) == [] and pick_rows(0, 4) == []


def test_long_responses_are_capped_but_decided_whole(tokenizer):
    n = MAX_RESPONSE_TOKENS + 10
    ids = tokenizer.encode(" one two three four five six seven eight nine ten") * (n // 10 + 1)
    s = Sample(group=0, prompt_ids=tokenizer.encode("count: "), response_ids=ids[:n], loss_mask=[1] * n,
               logp_sparse=[-1.0] * n, reward=1.0, status="truncated", num_turns=1)
    logp_old = [-1.0] * n
    logp_old[-1] = -1.0 - 12.0  # xi = e^-12 on a token past the cap: still vetoes the sequence
    rec = build_record(7, 0, s, LoggedRow(logp_old, 0.5), CorrectionConfig(), 1.0, tokenizer)
    assert rec["num_tokens"] == n and rec["tokens_dropped"] == 10
    assert all(len(v) == MAX_RESPONSE_TOKENS for v in rec["tokens"].values())
    assert rec["vetoed"] and rec["rejected"] and sum(rec["tokens"]["veto"]) == 0
    assert json.loads(json.dumps(rec)) == rec
    off = build_record(7, 0, s, LoggedRow(logp_old, 0.5), CorrectionConfig(enable=False), 1.0, tokenizer)
    assert off["correction"] == "off" and not off["rejected"] and set(off["tokens"]["weight"]) == {1.0}
    assert off["tokens"]["log_xi"][0] == 0.0 and math.isclose(off["advantage"], 0.5)


def test_truncate_after_keeps_covered_steps(tmp_path):
    log = SampleLog(tmp_path, 4, 0, CorrectionConfig(), tokenizer=None)
    log.dir.mkdir()
    for step in (1, 2, 3, 10):
        (log.dir / f"step_{step}.jsonl").write_text("{}\n")
    log.truncate_after(2)
    assert sorted(p.name for p in log.dir.iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    log.truncate_after(-1)
    assert list(log.dir.iterdir()) == []
    SampleLog(tmp_path, 4, 1, CorrectionConfig(), tokenizer=None).truncate_after(-1)  # other ranks touch nothing
