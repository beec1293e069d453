"""Tensor-parallel runs train (and evaluate) every rank of a TP group on its owner's samples.

The env module below pays a turn by the parity of the rank that runs it, the way an env that mixes in its
process (a rank, a clock, a remote service) would, and writes every call it gets to a file per rank. Runs of
the real trainer (torchrun, tiny random Llama, native engine, two turns per episode, evaluation during
training on the same env) with (dp, tp) = (1, 2) and (2, 2) must log the metrics of a one-process run, whose
env runs at rank 0 like the owners (the even ranks), up to TP rounding; and only the owners may have called
the env, with the calls of the one-process run. The same holds for context parallelism (parallel.cp=2), whose
run must log every metric of the one-process run to 1e-5. Were a peer to run its own env loop, its rewards, and so its
advantages, would differ from the owner's, and the update would mix two batches into one gradient. The same
holds for `python -m sparserl.eval` with tp=2.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_trainer import ROOT, read_metrics, trainer, write_data
from tests.launch import command
from tests.metric_reads import differences, tolerance

RANK_ENV = '''
import json
import os
from pathlib import Path

max_turns = 2


def _rank():
    return int(os.environ.get("RANK", "0"))


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 1)
    with (Path(os.environ["TP_ENV_LOG"]) / f"rank{_rank()}.jsonl").open("a") as f:
        f.write(json.dumps({"tail": state[-40:], "action": action, "turn": turn}) + "\\n")
    # Depends on the process: odd ranks pay other rewards. With tp=2 the owners are the even ranks.
    reward = float((len(action) + _rank() % 2) % 3)
    if turn == 1:
        return {"next_state": state + action + "\\nAgain:", "reward": reward, "done": False,
                "extra_info": {**extra_info, "turn": 2}}
    return {"next_state": None, "reward": reward, "done": True, "extra_info": extra_info}
'''

# Per-step numbers that depend on every sample and on the update; timings and memory do not belong here.
COMPARED = ("reward/mean", "reward/std", "score/mean", "env/turns_mean", "response/len_mean", "response/len_max",
            "actor/grad_norm", "actor/loss", "actor/pg_loss", "actor/entropy")
REL = 1e-4


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-6


def env_calls(folder: Path) -> dict[str, list[str]]:
    return {p.stem: sorted(p.read_text().splitlines()) for p in sorted(folder.glob("rank*.jsonl"))}


def run(tiny_checkpoint, tmp_path: Path, name: str, nproc: int, tp: int, cp: int = 1
        ) -> tuple[list[dict], dict[str, list[str]]]:
    prompts = [{"prompt": [{"role": "user", "content": f"Count to {k}."}], "answer": str(k)} for k in range(1, 5)]
    data = write_data(tmp_path / "train.jsonl", prompts)
    probe = write_data(tmp_path / "probe.jsonl", prompts[:2])
    env = tmp_path / "rank_env.py"
    env.write_text(RANK_ENV)
    out, calls = tmp_path / name, tmp_path / f"{name}_calls"
    calls.mkdir()
    # A random model seldom samples EOS: a stop string ends most first turns early, so that second turns happen.
    args = {"model.path": tiny_checkpoint, "model.compute_dtype": "float32", "rollout.dtype": "float32",
            "data.train_path": data, "env.path": env, "trainer.output_dir": out, "trainer.total_steps": 2,
            "trainer.prompts_per_step": 4, "rollout.n": 2, "rollout.max_new_tokens": 6, "rollout.stop_strings": "[e]",
            "actor.lr": 1e-3, "actor.max_tokens_per_device": 1024, "algo.entropy_coef": 0.01, "env.max_turns": 2,
            "parallel.tp": tp, "parallel.cp": cp, "trainer.eval_every": 2, "eval.datasets": f"[{{name:probe,path:{probe},env:{env}}}]", "eval.n": 2,
            "eval.temperature": 1.0, "eval.max_new_tokens": 4}
    res = trainer([f"{k}={v}" for k, v in args.items()], nproc=nproc, timeout=300, extra_env={"TP_ENV_LOG": str(calls)})
    assert res.returncode == 0, res.stderr[-4000:]
    return read_metrics(out), env_calls(calls)


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, tmp_path_factory):
    metrics, calls = run(tiny_checkpoint, tmp_path_factory.mktemp("one"), "one", nproc=1, tp=1)
    train = [m for m in metrics if m["step"] > 0]
    # The reference exercises what the test is about: second turns, rewards that differ within a step, updates.
    assert list(calls) == ["rank0"] and any('"turn": 2' in c for c in calls["rank0"]), calls
    assert all(m["actor/grad_norm"] > 0 and m["env/turns_mean"] > 1 and m["reward/std"] > 0 for m in train), train
    return metrics, calls


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2)])
def test_tp_peers_train_on_the_owners_samples(tiny_checkpoint, one_process, tmp_path, dp, tp):
    ref_metrics, ref_calls = one_process
    tp_metrics, tp_calls = run(tiny_checkpoint, tmp_path, "tp", nproc=dp * tp, tp=tp)

    # The env ran on the owners alone, and saw exactly what the one-process run's env saw (training and eval).
    owners = [f"rank{r}" for r in range(0, dp * tp, tp)]
    assert list(tp_calls) == owners, f"a TP peer ran the env itself: {sorted(tp_calls)}"
    assert sorted(c for calls in tp_calls.values() for c in calls) == ref_calls["rank0"]

    assert [m["step"] for m in tp_metrics] == [m["step"] for m in ref_metrics] == [0, 1, 2]
    for ref, got in zip(ref_metrics, tp_metrics):
        keys = [k for k in ref if k in COMPARED or k.startswith("eval/probe/")]
        assert keys and set(keys) <= set(got), (keys, sorted(got))
        bad = {k: (ref[k], got[k]) for k in keys if not close(ref[k], got[k], tolerance(k, REL))}
        assert not bad, f"step {ref['step']}: dp={dp} tp={tp} differs from one process (one, tp): {bad}"


def is_clock_or_memory(key: str) -> bool:
    return key.startswith(("perf/", "mem/", "time/")) or key.endswith(("time_s", "_s", "_tok_s"))


def test_context_parallel_run_equals_one_process(tiny_checkpoint, one_process, tmp_path):
    """parallel.cp=2: the two processes are one DP rank whose sequences are split over both (ring attention); the
    owner rolls out and runs the env, its cp peer trains on the same samples. Every metric of the run, training and
    evaluation, equals the one-process run's to 1e-5 (the ring sums attention in another order), the histogram reads
    (tests/metric_reads.py: every xi quantile, mismatch/ and sampler/ alike) to one bin of their histogram."""
    ref_metrics, ref_calls = one_process
    cp_metrics, cp_calls = run(tiny_checkpoint, tmp_path, "cp", nproc=2, tp=1, cp=2)
    assert list(cp_calls) == ["rank0"], f"a cp peer ran the env itself: {sorted(cp_calls)}"
    assert cp_calls["rank0"] == ref_calls["rank0"]
    assert [m["step"] for m in cp_metrics] == [m["step"] for m in ref_metrics] == [0, 1, 2]
    compared = set()
    for ref, got in zip(ref_metrics, cp_metrics):
        keys = [k for k in ref if isinstance(ref[k], (int, float)) and k != "step" and not is_clock_or_memory(k)]
        compared |= set(keys)
        missing = set(keys) - set(got)
        assert not missing, missing
        # The xi quantiles are read off a histogram of log-xi: a last-bit change may move one across a bin edge.
        bad = differences(ref, got, keys, rel=1e-5)
        assert not bad, f"step {ref['step']}: cp=2 differs from one process (one, cp): {bad}"
    assert set(COMPARED) <= compared and any(k.startswith("mismatch/") for k in compared), sorted(compared)


def test_standalone_eval_tp_peers_take_the_owners_result(tiny_checkpoint, tmp_path):
    env = tmp_path / "rank_env.py"
    env.write_text(RANK_ENV)
    probe = write_data(tmp_path / "probe.jsonl", [{"prompt": f"Count to {k}.", "answer": str(k)} for k in range(1, 4)])
    results = {}
    for name, nproc in (("one", 1), ("tp2", 2)):
        calls = tmp_path / f"{name}_calls"
        calls.mkdir()
        args = [f"model.path={tiny_checkpoint}", f"eval.datasets=[{{name:probe,path:{probe},env:{env}}}]", "eval.n=2",
                "eval.k=[1,2]", "eval.temperature=1.0", "eval.max_new_tokens=6", "rollout.dtype=float32",
                f"parallel.tp={nproc}", f"eval.output_dir={tmp_path / name}"]
        env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0",
                    "TP_ENV_LOG": str(calls)}
        res = subprocess.run(command(nproc, "-m", "sparserl.eval", *args), capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env=env_vars)
        assert res.returncode == 0, res.stderr[-3000:]
        results[name] = (env_calls(calls), json.loads((tmp_path / name / "eval.json").read_text())["datasets"])
    (one_calls, one), (tp_calls, tp) = results["one"], results["tp2"]
    assert list(tp_calls) == ["rank0"], f"a TP peer ran the env itself: {sorted(tp_calls)}"
    assert tp_calls == one_calls and tp == one
