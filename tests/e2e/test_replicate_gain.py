"""`benchmarks/replicate_gain.py`: `--quick` end to end on a tiny random model (warm-start, dense and the two
configurations with their own machinery (tail budget control, dense rescue) at two KV settings, records, a second
invocation that reruns nothing), every configuration's command and their differences (dry run), and the statistics."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import driver

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("dense", "tail", "rescue")  # the quick pipeline's configurations
sys.path.insert(0, str(ROOT))


def _script(folder, *argv, timeout=900):
    """The driver as `python benchmarks/replicate_gain.py ...`; the runs and evals it starts go through the test
    session's fork server (tests/launch.py), which has imported torch and transformers once for all of them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    res = subprocess.run(driver(folder, "benchmarks/replicate_gain.py") + list(map(str, argv)), env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    return res.stdout


@pytest.mark.slow
def test_quick_mode_records_every_run_and_resumes_from_the_records(tiny_checkpoint, tmp_path):
    out = tmp_path / "gain"
    # naive_sparse and sparse_rl are tail and rescue without their extra machinery, and the tight setting is the
    # loose one at another budget: their commands are checked by the dry run below, and the pipeline here runs the
    # three that exercise every code path at one setting (3 runs instead of 9).
    quick = ("--quick", "--model", tiny_checkpoint, "--out", out, "--precision", "float32", "--configs", *CONFIGS,
             "--settings", "loose", "--jobs", "2")  # two runs at a time (one thread each): the runs' output goes to their logs
    first = _script(tmp_path, *quick)
    records = out / "records"
    names = ["dense_seed0"] + [f"loose_{c}_seed0" for c in CONFIGS[1:]]
    for name in names:
        rec = json.loads((records / f"{name}.json").read_text())
        assert [m["step"] for m in rec["metrics"]] == [1, 2]
        assert len(rec["eval"]["scores"]) == 2 and rec["wall_s"] > 0
        assert rec["cmd"].startswith("python -m sparserl.trainer.grpo") and "OUT/runs/" + name in rec["cmd"]
        assert not (out / "runs" / name / "hf").exists()  # the policy is dropped once recorded
        assert rec["eval"]["kv"] == 1.0  # every policy is evaluated dense, the sparse runs' too
        kv = [m["kv/retained_frac"] for m in rec["metrics"]]
        assert all(k == 1.0 for k in kv) if name.startswith("dense") else all(k < 1.0 for k in kv)
    tail = json.loads((records / "loose_tail_seed0.json").read_text())["metrics"]
    assert tail[0]["kv/budget"] == 64  # the ceiling, 1.5 x the loose budget 40, aligned to 8
    assert all(40 <= m["kv/budget"] <= 64 for m in tail)
    rescue = json.loads((records / "loose_rescue_seed0.json").read_text())["metrics"]
    assert all("rescue/frac" in m for m in rescue)
    for name in ("warm-start", "warm-start_loose"):
        assert len(json.loads((records / f"{name}.json").read_text())["eval"]["scores"]) == 2
    summary = (out / "summary.md").read_text()
    for header in ("held-out gain ± SE (seeds)", "share of dense gain", "KV kept per seq (sampler)",
                   "KV of the trained seqs", "rejected seqs", "rescued seqs", "xi p05", "xi p01", "rollout s / dense",
                   "step s / dense", "min per run"):
        assert header in summary
    assert "| tail " in summary and "| rescue " in summary and "loose: every run" in summary
    assert (out / "loose_reward.png").stat().st_size > 0 and (out / "loose_diagnostics.png").stat().st_size > 0
    assert "[2/3] loose_tail_seed0" in first

    again = _script(tmp_path, *quick)
    assert again.count("recorded, not rerun") == len(names) and "(0 runs in" in again


def test_configurations_differ_only_where_they_should(capsys, tmp_path):
    from benchmarks import replicate_gain

    replicate_gain.main(["--dry-run", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()[1:]
    grpo = [shlex.split(line) for line in lines if "sparserl.trainer.grpo" in line]
    assert len(grpo) == 3 + 2 * 3 * 4

    def key(cmd, prefix):
        return [a for a in cmd if a.startswith(prefix)]

    def common(cmd):  # what every run of a seed shares
        drop = ("+preset=", "trainer.output_dir=", "algo.correction.", "rollout.kv.")
        return [a for a in cmd if not a.startswith(drop)]

    by_seed = {}
    for cmd in grpo:
        by_seed.setdefault(key(cmd, "trainer.seed=")[0], []).append(cmd)
    for cmds in by_seed.values():
        assert all(common(c) == common(cmds[0]) for c in cmds)
        assert all("model.compute_dtype=bfloat16" in c and "rollout.dtype=bfloat16" in c for c in cmds)
    tight_tail = next(c for c in grpo if "tight_tail_seed1" in " ".join(c))
    assert key(tight_tail, "rollout.kv.") == [
        "rollout.kv.budget=96", "rollout.kv.divide_length=16", "rollout.kv.compress_prompt=true",
        "rollout.kv.variant=reference", "rollout.kv.share=layer", "rollout.kv.budget=auto",
        "rollout.kv.control.floor=96", "rollout.kv.control.ceiling=144"]
    rescue = next(c for c in grpo if "loose_rescue_seed0" in " ".join(c))
    assert "+preset=sparse_rl" in rescue and "algo.correction.rescue=dense" in rescue
    replicate_gain.main(["--dry-run", "--out", str(tmp_path), "--configs", "tail_p01", "--seeds", "0"])
    p01 = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if "sparserl.trainer.grpo" in line]
    assert len(p01) == 2 and all(c[-3:-2] == ["rollout.kv.control.statistic=xi_p01"] for c in p01)
    assert key(p01[0], "rollout.kv.control.") == ["rollout.kv.control.floor=128", "rollout.kv.control.ceiling=192",
                                                  "rollout.kv.control.statistic=xi_p01"]
    # dense serves both settings: its KV keys do not follow --settings
    replicate_gain.main(["--dry-run", "--out", str(tmp_path), "--settings", "tight"])
    only_tight = [line for line in capsys.readouterr().out.splitlines() if "dense_seed0" in line]
    assert only_tight and "rollout.kv.budget=128" in only_tight[0]


def test_the_regime_task_keeps_the_prompt_whole_and_its_own_records(capsys, tmp_path):
    from benchmarks import replicate_gain

    args = replicate_gain.parse_args(["--task", "cycle_walk"])
    assert args.record == "docs/replications/sparse_regime" and args.out == "outputs/sparse_regime"
    assert args.settings == {"b80": 80} and args.precision == "float32" and not args.compress_prompt
    assert replicate_gain.parse_args(["--task", "cycle_walk", "--steps", "3"]).steps == 3  # the command line wins
    assert replicate_gain.parse_args([]).settings == {"loose": 128, "tight": 96}  # long_chain stays the default
    replicate_gain.main(["--dry-run", "--task", "cycle_walk", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()[1:]
    grpo = [shlex.split(line) for line in lines if "sparserl.trainer.grpo" in line]
    assert len(grpo) == 3 + 3 * 4
    for cmd in grpo:
        assert "env.path=envs/cycle_walk.py" in cmd and "rollout.kv.compress_prompt=false" in cmd
        assert "rollout.max_new_tokens=340" in cmd and "model.compute_dtype=float32" in cmd
    names = [a.rpartition("/")[2] for c in grpo for a in c if a.startswith("trainer.output_dir=")]
    assert "b80_rescue_group_seed2" in names and not [n for n in names if "_rescue_seed" in n]  # the group rescue
    evals = [shlex.split(line) for line in lines if "sparserl.eval" in line]
    assert [c for c in evals if "rollout.kv.budget=80" in c and "rollout.kv.algorithm=rkv" in c]
    # `sparserl.eval` takes a run's rollout.kv.* from its config.yaml: a sparse run's policy is evaluated dense only
    # because its command says so, and --eval-as-sampled leaves the run's compression in place
    assert all(("rollout.kv.algorithm=none" in r["eval_cmd"]) == (r["config"] != "dense")
               for r in replicate_gain.plan(args, tmp_path))
    as_sampled = replicate_gain.plan(replicate_gain.parse_args(["--task", "cycle_walk", "--eval-as-sampled"]), tmp_path)
    assert not [r for r in as_sampled if "rollout.kv.algorithm=none" in r["eval_cmd"]]
    sft = next(shlex.split(line) for line in lines if "sparserl.trainer.sft" in line)
    assert "env.path=envs/cycle_walk.py" in sft and "trainer.total_steps=6" in sft


def test_statistics():
    from benchmarks.replicate_gain import mean_se, prompt_se, run_gain, share

    assert mean_se([1.0, 3.0]) == (2.0, pytest.approx(1.0))  # std sqrt(2), over sqrt(2) values
    assert mean_se([0.5]) == (0.5, None) and mean_se([]) is None
    base = [0.0, 0.5, 1.0, 0.5]
    recs = [{"eval": {"scores": [0.5, 0.5, 1.0, 1.0]}}, {"eval": {"scores": [0.0, 1.0, 1.0, 0.5]}}]
    assert run_gain(recs[0], base) == pytest.approx(0.25) and run_gain(recs[1], base) == pytest.approx(0.125)
    # per-prompt gains averaged over the two seeds: 0.25, 0.25, 0, 0.25 -> std 0.125, over sqrt(4) prompts
    assert prompt_se(recs, base) == pytest.approx(0.0625)
    assert share((0.05, 0.01), (0.10, 0.02)) == "50% ± 14%"  # 0.5 * sqrt(0.2^2 + 0.2^2)
    assert share((0.05, 0.01), (-0.01, 0.02)) == "-" and share((0.05, None), (0.10, 0.02)) == "50%"
    assert share((0.0, 0.01), (0.10, 0.02)) == "0% ± 10%"
    with pytest.raises(ValueError, match="held-out scores"):
        run_gain({"eval": {"scores": [1.0]}}, base)


def test_walk_failures_by_lap(tmp_path):
    from benchmarks.gain_report import first_mistakes, walk_failures

    # 12-step walks over 3-link loops: k steps followed score k / 12; k = 12 is a whole walk
    scores = [k / 12 for k in (0, 2, 3, 5, 6, 11, 12, 12)]
    assert walk_failures(scores, lap=3, steps=12) == (2, 2, 2, 2)
    naive = [{"config": "naive_sparse", "setting": "b", "seed": s, "eval": {"scores": [k / 12 for k in ks]}}
             for s, ks in ((0, (12, 1, 4, 4)), (1, (12, 12, 4, 7)))]
    table = first_mistakes(tmp_path, scores, "b", {"dense": [], "naive_sparse": naive}, lap=3, steps=12)
    assert "| warm-start " in table and "| dense " not in table  # no dense record: no row
    # seed 0: 1 whole, 1 in lap 1, 2 in lap 2; seed 1: 2 whole, 1 in lap 2, 1 later
    assert "| naive_sparse | 2     | 1.5         | 0.5                    | 1.5      | 0.5   |" in table


def test_bad_settings_are_refused(capsys):
    from benchmarks import replicate_gain

    for bad in ("tight=8", "huge", "a=b", "1x=64"):
        with pytest.raises(SystemExit):
            replicate_gain.parse_args(["--settings", bad])
        assert "--settings" in capsys.readouterr().err
    assert replicate_gain.parse_args(["--settings", "tight", "mid=112"]).settings == {"tight": 96, "mid": 112}
