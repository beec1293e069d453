"""The KV budget controller under dynamic sampling and the correction: it steers by the sampler's own tail, every
sampled token the step scored densely before any filter, not by the batch that survives them (the groups the
correction rejects whole are the low-xi ones, so the trained batch's tail reads high). Checked against a tail the
test computes itself from every dense pass the actor ran (tests/e2e/dense_pass_recorder.py), on a real 2-process
run whose engine compresses and whose correction rejects."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sparserl.kv.budget_control import BudgetControlConfig, BudgetController
from tests.e2e.test_dynamic_sampling import PARITY_ENV
from tests.e2e.test_trainer import ROOT, read_metrics, tiny_args, write_data
from tests.launch import command

RECORDER = Path(__file__).with_name("dense_pass_recorder.py")
CONTROL = {"floor": 8, "ceiling": 24, "target": 0.5, "hysteresis": 0.0, "factor": 2.0, "patience": 1, "align": 4}


def _expected_tail(records: list[dict], q: float = 0.05) -> tuple[float, int, int]:
    """(the q-quantile of xi over the tokens of every sequence scored once or more, tokens, sequences). The token set
    is the test's own; the quantile is read as the trainer reads it (a histogram of log xi, bins of 0.002), so the
    two agree exactly on the same tokens and differ on others."""
    from sparserl.algo.correction import _log_xi_histogram, histogram_quantile

    seen, log_xi = set(), []
    for r in records:
        for i, ids in enumerate(r["ids"]):
            if tuple(ids) in seen:  # scored again (dynamic sampling's fallback to round 1's groups)
                continue
            seen.add(tuple(ids))
            on = r["mask"][i] > 0
            log_xi.append((r["logp_old"][i] - r["logp_sparse"][i]).clamp(-20, 20)[on])
    values = torch.cat(log_xi) if log_xi else torch.zeros(0)
    return histogram_quantile(_log_xi_histogram(values), q), values.numel(), len(seen)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_budget_controller_reads_the_sampler_s_tail_before_dynamic_sampling_drops_groups(tiny_checkpoint, tmp_path):
    import subprocess

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1), (3, 3), (6, 2), (7, 1), (2, 2)]]
    data, env = write_data(tmp_path / "train.jsonl", rows), tmp_path / "env.py"
    env.write_text(PARITY_ENV)
    out = tmp_path / "run"
    args = tiny_args(tiny_checkpoint, data, env, out, steps=3, **{
        "algo.dynamic_sampling.enable": "true", "algo.dynamic_sampling.max_rounds": 3, "rollout.n": 4,
        "algo.correction.enable": "true", "algo.correction.mode": "apply", "algo.correction.veto": 0.92,
        "algo.correction.rejected_in_baseline": "false", "rollout.max_new_tokens": 24,
        "rollout.kv.algorithm": "rkv", "rollout.kv.budget": "auto", "rollout.kv.window": 2,
        "rollout.kv.divide_length": 4, "rollout.kv.compress_prompt": "true",
        **{f"rollout.kv.control.{k}": v for k, v in CONTROL.items()}})
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    res = subprocess.run(command(2, RECORDER, tmp_path / "passes", *args), env=env_vars, capture_output=True,
                         text=True, timeout=800, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kv budget: steered by sampler/xi_p05" in res.stdout + res.stderr
    records = [r for rank in (0, 1) for r in torch.load(tmp_path / f"passes.rank{rank}.pt")]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    ctrl = BudgetController(BudgetControlConfig(**CONTROL))
    trained_differs = False
    for m in metrics:
        tail, tokens, seqs = _expected_tail([r for r in records if r["step"] == m["step"]])
        assert m["sampler/tokens"] == tokens and m["sampler/seqs"] == seqs, m["step"]
        assert m["kv/budget_tail"] == pytest.approx(tail, rel=1e-9), (
            f"step {m['step']}: the controller read {m['kv/budget_tail']}, the sampler's tail is {tail} "
            f"(the trained batch's: {m['mismatch/xi_p05']})")
        assert m["sampler/xi_p05"] == m["kv/budget_tail"]
        assert m["kv/budget"] == ctrl.budget, m["step"]  # the budget each step came from the tails before it
        ctrl.update(tail)
        trained_differs |= m["mismatch/xi_p05"] != pytest.approx(tail, rel=1e-9)
    assert sum(m["kv/compressions"] for m in metrics) > 0, "the engine never compressed: the test covers nothing"
    assert any(m["sampler/rejected_seq_frac"] > 0 for m in metrics), "nothing rejected: the filters never mattered"
    assert any(m["dynamic/prompts_drawn"] > m["dynamic/groups"] for m in metrics), "no group was dropped"
    assert trained_differs, "the trained batch's tail equals the sampler's on every step: the test cannot tell them apart"


@pytest.mark.parametrize("mode", ["off", "measure"])
def test_with_an_auto_budget_every_sampled_sequence_reaches_the_tail(tiny_checkpoint, tmp_path, mode):
    """rollout.kv.budget=auto under dynamic sampling with the correction off or measuring: the groups dropped for tied
    rewards get a dense pass too, so `sampler/*` (what the controller steers by) counts every sampled sequence of
    every round, not only the trained batch's, and reads another tail than `mismatch/*` where groups were dropped."""
    from tests.e2e.test_trainer import trainer

    # Half the prompts pay 0 whatever the answer (their groups tie and are dropped), the others the answer's parity.
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?" + (" (tied)" if a % 2 else "")}],
             "answer": str(a + b)} for a, b in [(1, 1), (2, 3), (4, 4), (5, 1), (3, 3), (6, 2), (7, 1), (2, 2)]]
    data, env = write_data(tmp_path / "train.jsonl", rows), tmp_path / "env.py"
    env.write_text(PARITY_ENV.replace("r = float(", "r = 0.0 if '(tied)' in state else float("))
    out = tmp_path / "run"
    correction = {"algo.correction.enable": "false"} if mode == "off" else {"algo.correction.enable": "true",
                                                                             "algo.correction.mode": "measure"}
    res = trainer(tiny_args(tiny_checkpoint, data, env, out, steps=2, **{
        "algo.dynamic_sampling.enable": "true", "algo.dynamic_sampling.max_rounds": 2, "rollout.n": 4,
        "rollout.max_new_tokens": 12, "rollout.kv.algorithm": "rkv", "rollout.kv.budget": "auto",
        "rollout.kv.window": 2, "rollout.kv.divide_length": 4, "rollout.kv.compress_prompt": "true",
        "trainer.export_hf": "false", **correction, **{f"rollout.kv.control.{k}": v for k, v in CONTROL.items()}}),
        nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    for m in metrics:
        assert m["sampler/seqs"] == 4 * m["dynamic/prompts_drawn"], (m["step"], m["sampler/seqs"], m["dynamic/groups"])
        assert m["kv/budget_tail"] == m["sampler/xi_p05"]
    assert any(m["dynamic/prompts_drawn"] > m["dynamic/groups"] for m in metrics), "no group was dropped"
    assert "every round's samples are scored densely" in res.stdout + res.stderr  # the separate pass, said why
