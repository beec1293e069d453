"""The lines a training run ends with (sparserl/trainer/summary.py), from a run folder's metrics.jsonl."""
import json

from sparserl.trainer.summary import closing_lines


def write_metrics(folder, rewards, kv=None):
    rows = [{"step": i + 1, "reward/mean": r, **({"kv/retained_frac": kv[i]} if kv else {})} for i, r in enumerate(rewards)]
    rows.insert(0, {"step": 0, "eval/env/avg@1": 0.1})  # the step-0 evaluation row is not a training step
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_finished_run_says_steps_reward_kv_time_and_what_to_run(tmp_path):
    write_metrics(tmp_path, [0.0, 0.25, 0.5, 0.5, 0.75, 1.0], kv=[0.5, 0.4, 0.3, 0.3, 0.3, 0.2])
    lines = closing_lines(tmp_path, 6, 6, 754.2)
    assert lines[0] == ("done: 6 of 6 steps in 12 min 34 s | reward 0.250 (steps 1-3) -> 0.750 (steps 4-6) | "
                        "kv kept 33.3% of a dense cache")
    assert lines[1] == f"report:   python -m sparserl.report {tmp_path}"
    assert lines[2] == f"evaluate: python -m sparserl.eval model.path={tmp_path} 'eval.datasets=[env]'"
    assert len(lines) == 3


def test_a_stopped_run_says_where_and_how_to_continue(tmp_path):
    write_metrics(tmp_path, [0.125, 0.5])
    lines = closing_lines(tmp_path, 2, 30, 42.0, "trainer.stop_after")
    assert lines[0] == "done: stopped at step 2 of 30 (trainer.stop_after) in 42 s | reward 0.125 (step 1) -> 0.500 (step 2)"
    assert lines[-1] == f"continue: the same command with trainer.resume=auto trainer.output_dir={tmp_path}"
