"""Two-process runs (gloo) of `sparserl.trainer.rm` and `sparserl.trainer.dpo` on the shipped pairs: 2 steps each,
finite metrics, the held-out evaluation before and after, the exports, and a resumed RM run."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]


def launch(module: str, args: dict, timeout: int = 240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    argv = [f"{k}={v}" for k, v in args.items()]
    return subprocess.run(command(2, "-m", module, *argv), env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def tiny(ckpt, out, section: str, **extra) -> dict:
    return {"model.path": ckpt, "model.compute_dtype": "float32", "trainer.output_dir": out, "trainer.total_steps": 2,
            "trainer.prompts_per_step": 4, "actor.lr": 1e-3, f"{section}.eval_limit": 4, f"{section}.max_length": 256,
            **extra}


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_two_process_reward_model_run_evaluates_exports_and_resumes(tiny_checkpoint, tmp_path):
    out = tmp_path / "rm"
    res = launch("sparserl.trainer.rm", tiny(tiny_checkpoint, out, "rm"))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        assert math.isfinite(m["rm/loss"]) and 0 <= m["rm/accuracy"] <= 1 and m["actor/grad_norm"] > 0
    assert metrics[0]["eval/rm/accuracy"] is not None and "eval/rm/accuracy" in metrics[2]
    assert "step 2/2 | loss" in res.stdout
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out / "hf")
    assert config.architectures[0].endswith("ForSequenceClassification") and config.num_labels == 1
    assert (out / "config.yaml").read_text().startswith("# sparserl.trainer.rm")

    res = launch("sparserl.trainer.rm", tiny(tiny_checkpoint, out, "rm", **{"trainer.total_steps": 3,
                                                                            "trainer.resume": "auto"}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and [m["step"] for m in rows(out)] == [0, 1, 2, 3]


def test_a_two_process_dpo_run_with_lora_and_ipo(tiny_checkpoint, tmp_path):
    out = tmp_path / "dpo"
    res = launch("sparserl.trainer.dpo", tiny(tiny_checkpoint, out, "dpo", **{"dpo.loss": "ipo", "actor.lora.rank": 4}))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # step 0: the policy is its reference, so every implicit reward is 0 and IPO's loss is (1 / (2 beta))^2 = 25
    assert metrics[0]["eval/dpo/margin"] == 0 and abs(metrics[0]["eval/dpo/loss"] - 25.0) < 1e-6
    assert all(math.isfinite(m["dpo/loss"]) for m in metrics[1:]) and metrics[2]["actor/grad_norm"] > 0
    assert (out / "hf" / "adapter_config.json").exists()
    from sparserl.config.load import load_config
    from sparserl.eval.run_settings import take_run_settings

    argv = [f"model.path={out / 'hf'}"]  # a DPO run sampled nothing: eval takes no sampling setting from it
    _, said = take_run_settings(load_config(argv, "eval"), argv)
    assert len(said) == 1 and "a DPO run's config: it sampled nothing" in said[0], said


def test_a_pair_file_without_chosen_and_rejected_stops_with_one_line(tiny_checkpoint, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "response": "2"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(command(1, "-m", "sparserl.trainer.dpo", f"model.path={tiny_checkpoint}",
                                 f"data.train_path={data}", f"trainer.output_dir={tmp_path / 'out'}"),
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "row 0" in errors[0] and "'chosen'" in errors[0], res.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_context_and_tensor_parallel_reward_model_steps_are_the_one_process_step(tiny_checkpoint, tmp_path):
    """parallel.cp=2 splits every packed pair over two ranks (ring attention, the score head on the rank holding each
    sequence's last row); parallel.tp=2 splits the decoder and replicates the score head: the same loss, gradient
    norm and held-out scores as one process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    got = {}
    for name, nproc, extra in (("one", 1, {}), ("cp2", 2, {"parallel.cp": 2}), ("tp2", 2, {"parallel.tp": 2})):
        out = tmp_path / name
        args = tiny(tiny_checkpoint, out, "rm", **{"trainer.total_steps": 1, "trainer.export_hf": "false", **extra})
        res = subprocess.run(command(nproc, "-m", "sparserl.trainer.rm", *[f"{k}={v}" for k, v in args.items()]),
                             env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        m = rows(out)
        got[name] = [m[1]["rm/loss"], m[1]["actor/grad_norm"], m[0]["eval/rm/margin"], m[1]["eval/rm/margin"]]
    assert got["cp2"] == pytest.approx(got["one"], abs=1e-6), got
    assert got["tp2"] == pytest.approx(got["one"], abs=1e-5), got
