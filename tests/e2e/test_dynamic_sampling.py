"""Dynamic sampling (`algo.dynamic_sampling.*`) in real 2-process torchrun runs of a tiny model: steps that need
more than one round, the correction applied to every round (its dense pass and the engine woken again), and a run
stopped after step 2 and resumed that logs the same steps and ends with the same weights as the uninterrupted one.
Every rank training on the same number of groups is checked apart (tests/distributed/test_dynamic_sampling_dist.py)."""
from __future__ import annotations

import pytest

from sparserl.trainer.metric_names import find
from tests.e2e.test_faults import assert_same_run
from tests.e2e.test_trainer import read_metrics, side_by_side, tiny_args, trainer, write_data

# A reward that varies between the samples of a random model: the parity of the answer's characters.
PARITY_ENV = '''
max_turns = 1

async def step(state, action, extra_info):
    r = float(sum(map(ord, action)) % 2)
    return {"next_state": None, "reward": r, "score": r, "done": True, "extra_info": extra_info}
'''

def _args(ckpt, data, env, out, **extra):
    return tiny_args(ckpt, data, env, out, steps=3, **{
        "+preset": "dense", "algo.correction.enable": "true", "algo.dynamic_sampling.enable": "true",
        "algo.dynamic_sampling.max_rounds": 3, "algo.overlong.penalty": 0.5, "algo.overlong.buffer": 2,
        "rollout.max_new_tokens": 4, **extra})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1), (3, 3), (6, 2), (7, 1), (2, 2)]]
    env = root / "env.py"
    env.write_text(PARITY_ENV)
    return write_data(root / "train.jsonl", rows), env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_in_the_middle_matches_the_uninterrupted_run(tiny_checkpoint, task, tmp_path):
    data, env = task
    full, parted = tmp_path / "full", tmp_path / "parted"

    def stop_then_resume():
        res = trainer(_args(tiny_checkpoint, data, env, parted, **{"trainer.stop_after": 2}), nproc=2)
        assert res.returncode == 0, res.stderr[-3000:]
        return trainer(_args(tiny_checkpoint, data, env, parted, **{"trainer.resume": "auto"}), nproc=2)

    res, resumed = side_by_side(lambda: trainer(_args(tiny_checkpoint, data, env, full), nproc=2), stop_then_resume)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "old log-probs: a separate forward pass (algo.dynamic_sampling" in res.stdout + res.stderr
    rows = read_metrics(full)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert 1 <= m["dynamic/rounds"] <= 3 and m["dynamic/prompts_drawn"] >= 4
        assert m["dynamic/groups"] in (2.0, 4.0) and m["dynamic/groups"] % 2 == 0
        assert m["dynamic/target_reached"] == float(m["dynamic/groups"] == 4)
        assert m["overlong/penalty_mean"] >= 0 and m["actor/grad_norm"] > 0
    assert any(m["dynamic/rounds"] > 1 for m in rows), "no step needed a second round: the run covers too little"
    assert not sorted({k for m in rows for k in m if find(k) is None})

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert_same_run(full, parted)


ZERO_ENV = '''
max_turns = 1

async def step(state, action, extra_info):
    return {"next_state": None, "reward": 0.0, "done": True, "extra_info": extra_info}
'''


def test_no_group_with_a_signal_under_the_applied_correction(tiny_checkpoint, task, tmp_path):
    """Every reward 0 (a hard task at its start): no rank has an informative group in any round, so the step falls back
    to round 1's groups, none of which round 1 scored densely. The fallback's dense pass plans no micro-batch on any
    rank; the step must still train (on no reward signal: the advantages are 0, the entropy bonus is the gradient)
    and say so, not crash (a crash would recur at every resume, as the round's draw is keyed)."""
    data, _ = task
    env = tmp_path / "zero_env.py"
    env.write_text(ZERO_ENV)
    out = tmp_path / "zero"
    res = trainer(_args(tiny_checkpoint, data, env, out, **{"trainer.total_steps": 2,
                                                            "algo.dynamic_sampling.max_rounds": 2,
                                                            "algo.overlong.penalty": 0.0}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    log = res.stdout + res.stderr
    assert "no group carries a learning signal" in log, log[-3000:]
    rows = read_metrics(out)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["reward/mean"] == 0.0 and m["dynamic/rounds"] == 2 and m["dynamic/target_reached"] == 0.0
        assert m["dynamic/groups"] == 4.0  # round 1's groups, as they are
        assert m["sampler/seqs"] > 0  # the fallback's dense pass scored them: the sampler tail sees them
