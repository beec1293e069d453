"""`benchmarks/replicate_long.py`: `--quick` end to end on a tiny random model (warm-start, the three presets, held-out
evaluation, summary, plots), and, without running anything, the commands and the statistics over seeds."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import driver

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("dense", "naive_sparse", "sparse_rl")
sys.path.insert(0, str(ROOT))


@pytest.mark.slow
def test_quick_mode_runs_every_config(tiny_checkpoint, tmp_path):
    out = tmp_path / "long"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    # The runs and evals the driver starts go through the test session's fork server (tests/launch.py).
    res = subprocess.run(driver(tmp_path, "benchmarks/replicate_long.py") + [
        "--quick", "--model", str(tiny_checkpoint), "--out", str(out), "--jobs", "2"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])

    for preset in PRESETS:
        rows = [json.loads(line) for line in (out / preset / "seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            # the new diagnostic on every preset; the filters' rejection rate measured even where not applied
            assert 0.0 <= r["mismatch/low_xi_pos_adv_frac"] <= 1.0
            assert 0.0 <= r["correction/rejected_seq_frac"] <= 1.0
            assert "actor/entropy" in r and "actor/grad_norm" in r and "mismatch/kl" in r
            assert (r["kv/retained_frac"] == 1.0) == (preset == "dense")
        assert (out / "eval" / f"{preset}_seed0" / "samples.jsonl").exists()
    assert (out / "eval" / "warm-start_dense" / "samples.jsonl").exists()
    assert (out / "eval" / "warm-start_rkv" / "samples.jsonl").exists()

    summary = (out / "summary.md").read_text()
    for preset in PRESETS:
        assert f"| {preset}" in summary
    assert "±" in summary and "pos-adv tokens with xi < 0.1" in summary and "held-out gain over warm-start" in summary
    assert (out / "reward.png").stat().st_size > 0 and (out / "diagnostics.png").stat().st_size > 0
    band = json.loads((out / "curves.json").read_text())["sparse_rl"]["reward/mean"]
    assert band["steps"] == [1, 2] and band["seeds"] == [1, 1]


def test_runs_of_a_seed_differ_only_in_the_preset(capsys, tmp_path):
    from benchmarks import replicate_long

    replicate_long.main(["--dry-run", "--out", str(tmp_path), "--seeds", "0", "1", "2"])
    lines = capsys.readouterr().out.splitlines()[1:]
    sft, grpo = lines[0], [shlex.split(line) for line in lines[1:]]
    assert "sparserl.trainer.sft" in sft and len(grpo) == 9

    def normalized(cmd):  # without what may differ: the preset, the output folder, the measure-mode switch
        return [a for a in cmd if not a.startswith(("+preset=", "trainer.output_dir=", "algo.correction."))]

    by_seed = {}
    for cmd in grpo:
        seed = next(a for a in cmd if a.startswith("trainer.seed="))
        by_seed.setdefault(seed, []).append(cmd)
    assert sorted(by_seed) == ["trainer.seed=0", "trainer.seed=1", "trainer.seed=2"]
    for cmds in by_seed.values():
        assert [next(a for a in c if a.startswith("+preset=")) for c in cmds] == [f"+preset={p}" for p in PRESETS]
        assert normalized(cmds[0]) == normalized(cmds[1]) == normalized(cmds[2])
        assert "rollout.kv.compress_prompt=false" in cmds[0] and "env.path=envs/long_chain.py" in cmds[0]
        measured = ["algo.correction.enable=true", "algo.correction.mode=measure"]
        assert all(a in cmds[0] and a in cmds[1] for a in measured) and not any(a in cmds[2] for a in measured)


def test_statistics_over_seeds():
    from benchmarks.replicate_long import curves, mean_std, pm, training_gain

    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    assert mean_std([5.0]) == (5.0, 0.0) and mean_std([]) is None and mean_std([None, float("nan")]) is None
    assert pm((0.1234, 0.05), sign=True) == "+0.123 ± 0.050"
    rows = [{"step": s, "reward/mean": r} for s, r in enumerate([0.1, 0.2, 0.3, 0.5, 0.6, 0.7], start=1)]
    assert training_gain(rows, 2) == pytest.approx(0.65 - 0.15)
    metrics = {("dense", 0): [{"step": 1, "reward/mean": 0.2, "x": 1.0}, {"step": 2, "reward/mean": 0.4}],
               ("dense", 1): [{"step": 1, "reward/mean": 0.4, "x": 3.0}, {"step": 2, "reward/mean": 0.4}],
               ("sparse_rl", 0): [{"step": 1, "reward/mean": 0.0}]}
    c = curves(metrics, ["dense", "sparse_rl"], ("x",))
    assert c["dense"]["reward/mean"]["steps"] == [1, 2] and c["dense"]["reward/mean"]["seeds"] == [2, 2]
    assert c["dense"]["reward/mean"]["mean"] == pytest.approx([0.3, 0.4])
    assert c["dense"]["reward/mean"]["std"] == pytest.approx([0.1 * 2 ** 0.5, 0.0])  # sample std of 0.2, 0.4
    assert c["dense"]["x"] == {"steps": [1], "mean": [2.0], "std": [pytest.approx(2 ** 0.5)], "seeds": [2]}
    assert c["sparse_rl"]["x"]["steps"] == []


def test_jobs_run_side_by_side_in_order_and_a_failure_exits(tmp_path, capsys):
    from benchmarks.replicate_sparse_rl import run, run_all

    stamp = "import sys, time; t = time.time(); time.sleep(1.5); print(t, time.time()); sys.exit(int(sys.argv[1]))"
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    took = run_all([lambda log=log: run([sys.executable, "-c", stamp, "0"], log) for log in logs], jobs=2)
    assert len(took) == 3 and all(t >= 1.5 for t in took)
    spans = [tuple(map(float, log.read_text().split())) for log in logs]
    assert spans[1][0] < spans[0][1] and spans[0][0] < spans[1][1]  # the first two ran at the same time
    assert max(spans[0][1], spans[1][1]) <= spans[2][0] + 0.5  # the third waited for a free job
    printed = capsys.readouterr().out
    assert printed.count("started: ") == 3 and printed.count("finished in ") == 3
    assert all(log.read_text().strip() not in printed for log in logs)  # each job's output is in its log only

    with pytest.raises(SystemExit, match=r"failed with exit code 3; its output is in .*bad\.log"):
        run_all([lambda: run([sys.executable, "-c", stamp, "0"], tmp_path / "ok.log"),
                 lambda: run([sys.executable, "-c", stamp, "3"], tmp_path / "bad.log")], jobs=2)
    assert (tmp_path / "ok.log").read_text().strip()  # the other job ran to its end
