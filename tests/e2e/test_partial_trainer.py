"""A tiny GRPO run with partial rollouts: the partial/ metrics, a resume with samples in flight that continues as the
uninterrupted run did, and the refusals of what partial rollouts do not combine with. (The carried-sample claims are
tested in process, cheaply: tests/unit/test_partial_rollouts.py.)"""
import pytest

from tests.e2e.test_trainer import read_metrics, side_by_side, tiny_args, trainer, write_data

ENV = '''
max_turns = 1

async def step(state, action, extra_info):
    reward = float(len(action) % 3 == 0)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
'''
PARTIAL = {"rollout.partial.enable": "true", "rollout.partial.finish_frac": 0.5, "rollout.partial.max_tokens": 3,
           "rollout.partial.max_staleness": 2, "rollout.max_new_tokens": 12,
           "rollout.stop_strings": "[a,e,o]",  # responses of the random model end anywhere: some samples are carried
           "algo.correction.enable": "true",
           "algo.correction.mode": "measure", "trainer.save_every": 1}


@pytest.fixture
def task(tmp_path):
    rows = [{"prompt": f"Say something about {w}.", "answer": "0"} for w in ("cats", "rain", "tea", "maps")]
    env = tmp_path / "env.py"
    env.write_text(ENV)
    return write_data(tmp_path / "train.jsonl", rows), env


@pytest.mark.slow
def test_partial_run_logs_its_metrics_and_resumes_with_samples_in_flight(tiny_checkpoint, task, tmp_path):
    data, env = task
    full, cut = tmp_path / "full", tmp_path / "cut"

    def cut_then_resume():
        res = trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=4, **PARTIAL, **{"trainer.stop_after": 2}))
        assert res.returncode == 0, res.stderr[-3000:]
        return trainer(tiny_args(tiny_checkpoint, data, env, cut, steps=4, **PARTIAL, **{"trainer.resume": "auto"}))

    whole, resumed = side_by_side(lambda: trainer(tiny_args(tiny_checkpoint, data, env, full, steps=4, **PARTIAL)),
                                  cut_then_resume)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(full), read_metrics(cut)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    assert sum(m["partial/in_flight"] for m in a[:3]) > 0 and max(m["partial/carried_frac"] for m in a) > 0
    for m in a:
        assert sum(m[f"partial/tokens_age{k}"] for k in range(3)) == pytest.approx(1.0)
        assert m["partial/trained_samples"] > 0
    for x, y in zip(a, b):  # the resumed run goes on with the samples it had in flight
        for key in ("partial/in_flight", "partial/trained_samples", "reward/mean", "response/len_mean"):
            assert x[key] == y[key], (x["step"], key)
        assert x["mismatch/kl"] == pytest.approx(y["mismatch/kl"], abs=1e-6)
