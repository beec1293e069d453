"""Logged samples (`trainer.log_samples`, sparserl/trainer/samples.py): which rows are logged, how long responses are
capped, and resume (a real step's records against the loss's tensors is tests/process/test_samples_run.py)."""
import json
import math
from pathlib import Path


from sparserl.algo.correction_config import CorrectionConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.samples import MAX_RESPONSE_TOKENS, LoggedRow, SampleLog, build_record, pick_rows

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "samples_worker.py"


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
