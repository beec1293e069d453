"""`python -m sparserl.eval model.path=<run folder>` samples as the run did: the run's length cap
(`rollout.max_new_tokens`) and KV settings (`rollout.kv.*`) from its config.yaml, unless the command line sets
them, and it prints what it took from where."""
import json
import os
import shutil
import subprocess
from pathlib import Path

from sparserl.config import to_yaml
from sparserl.config.load import load_config
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}


def make_run(tiny_checkpoint: Path, root: Path) -> Path:
    """A finished run's folder as the trainer leaves it: config.yaml (a length cap and a KV preset other than eval's
    defaults) and the exported hf/."""
    run = root / "run"
    run.mkdir()
    cfg = load_config([f"model.path={tiny_checkpoint}", "+preset=sparse_rl", "rollout.max_new_tokens=24",
                       "rollout.kv.budget=48", f"trainer.output_dir={run}"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    shutil.copytree(tiny_checkpoint, run / "hf")
    return run


def evaluate(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [f"model.path={model}", f"eval.output_dir={out}", "eval.datasets=[mawps]", "eval.limit=2",
            "rollout.dtype=float32", *extra]
    return subprocess.run(command(1, "-m", "sparserl.eval", *args), env=ENV, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def test_eval_of_a_run_folder_takes_its_length_cap_and_kv_settings(tiny_checkpoint, tmp_path):
    run = make_run(tiny_checkpoint, tmp_path)
    res = evaluate(run, tmp_path / "as_run")
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    settings = json.loads((tmp_path / "as_run" / "eval.json").read_text())
    assert settings["eval"]["max_new_tokens"] == 24
    kv = settings["rollout"]["kv"]
    assert (kv["algorithm"], kv["budget"], kv["variant"], kv["share"]) == ("rkv", 48, "reference", "layer")
    for s in map(json.loads, (tmp_path / "as_run" / "samples.jsonl").read_text().splitlines()):
        assert 0 < s["tokens"] <= 24
    taken = lines(res.stdout, "eval: from the run's config")
    assert len(taken) == 1 and str(run / "config.yaml") in taken[0], res.stdout
    for item in ("eval.max_new_tokens=24 (its rollout.max_new_tokens)", "rollout.kv.algorithm=rkv",
                 "rollout.kv.budget=48", "rollout.kv.variant=reference", "rollout.kv.share=layer"):
        assert item in taken[0], taken[0]
    assert not lines(res.stdout, "eval: set on the command line"), res.stdout


def test_the_command_line_wins_over_the_run_and_says_so(tiny_checkpoint, tmp_path):
    run = make_run(tiny_checkpoint, tmp_path)
    res = evaluate(run / "hf", tmp_path / "mine", "eval.max_new_tokens=8", "rollout.kv.share=head")
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    settings = json.loads((tmp_path / "mine" / "eval.json").read_text())
    assert settings["eval"]["max_new_tokens"] == 8
    kv = settings["rollout"]["kv"]
    assert (kv["algorithm"], kv["budget"], kv["variant"], kv["share"]) == ("rkv", 48, "reference", "head")
    taken = lines(res.stdout, "eval: from the run's config")
    assert len(taken) == 1 and "rollout.kv.variant=reference" in taken[0], res.stdout
    assert "eval.max_new_tokens" not in taken[0] and "rollout.kv.share" not in taken[0], taken[0]
    mine = lines(res.stdout, "eval: set on the command line")
    assert len(mine) == 1, res.stdout
    assert "eval.max_new_tokens=8 (the run's: 24)" in mine[0] and "rollout.kv.share=head (the run's: layer)" in mine[0]


def test_run_folder_of_each_model_path(tiny_checkpoint, tmp_path):
    from sparserl.eval.run_settings import run_folder

    run = make_run(tiny_checkpoint, tmp_path)
    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    assert run_folder(str(run)) == run
    assert run_folder(str(run / "hf")) == run
    assert run_folder(str(step)) == run
    assert run_folder(str(tiny_checkpoint)) is None  # a Hugging Face folder of no run
    assert run_folder("smollm2-135m-instruct") is None


def test_command_line_keys_count_a_presets_keys():
    from sparserl.eval.run_settings import command_line_keys

    keys = command_line_keys(["--config-name", "eval", "eval.n=2", "+preset=dense", "rollout.kv.budget=64"])
    assert {"eval.n", "rollout.kv.budget", "rollout.kv.algorithm", "algo.correction.enable"} <= keys
    assert "eval" not in keys and "rollout.kv.share" not in keys


def test_a_dense_command_line_takes_none_of_the_runs_kv_keys(tmp_path):
    """`+preset=dense` on an auto-budget run: dense, with eval's KV keys (the run's budget=auto would be refused
    beside algorithm=none), and the run's length cap still taken."""
    from sparserl.eval.run_settings import take_run_settings

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(["+preset=sparse_rl", "rollout.kv.budget=auto",
                                                          "rollout.max_new_tokens=40"])))
    argv = [f"model.path={run}", "+preset=dense"]
    cfg, said = take_run_settings(load_config(argv, "eval"), argv)
    assert (cfg.rollout.kv.algorithm, cfg.rollout.kv.budget, cfg.rollout.kv.variant) == ("none", 512, "paper")
    assert cfg.eval.max_new_tokens == 40
    assert len(said) == 2 and "eval.max_new_tokens=40" in said[0] and "rollout.kv" not in said[0]
    assert "rollout.kv.algorithm=none (the run's: rkv)" in said[1] and "not taken" in said[1]


def _auto_run(root: Path, steps_saved: dict[int, int | None]) -> Path:
    """An auto-budget run's folder: config.yaml and, per step, a complete checkpoint whose trainer_state.pt holds the
    budget controller's state as the trainer saves it (`kv_budget`), or none (None)."""
    import torch

    from sparserl.actor.checkpoint import STATE_FILE, checkpoint_dir

    run = root / "run"
    (run / "hf").mkdir(parents=True)  # the export, whose weights the last checkpoint holds (none needed here)
    (run / "config.yaml").write_text(to_yaml(load_config(["+preset=sparse_rl", "rollout.kv.budget=auto",
                                                          "rollout.kv.control.ceiling=256"])))
    for step, budget in steps_saved.items():
        ckpt = checkpoint_dir(run, step)
        ckpt.mkdir(parents=True)
        state = {"step": step} | ({"kv_budget": {"budget": budget, "calm": 0}} if budget is not None else {})
        torch.save(state, ckpt / STATE_FILE)
        (ckpt / "COMPLETE").write_text("")
    return run


def test_an_auto_budget_run_is_evaluated_at_its_controllers_saved_budget(tmp_path):
    """Not the ceiling: the budget the controller had reached, from the checkpoint of the evaluated weights (the last
    one for the run folder or hf/), said in a line; the config eval.json records holds the number."""
    from sparserl.eval.run_settings import take_run_settings

    run = _auto_run(tmp_path, {2: 160, 4: 96})
    for model, want, step in ((run, 96, 4), (run / "hf", 96, 4), (run / "checkpoints" / "step_000002", 160, 2)):
        argv = [f"model.path={model}"]
        cfg, said = take_run_settings(load_config(argv, "eval"), argv)
        assert cfg.rollout.kv.budget == want and cfg.rollout.kv.algorithm == "rkv", (model, cfg.rollout.kv)
        line = [s for s in said if "rollout.kv.budget=auto" in s]
        assert len(line) == 1 and f"{want}, its budget controller's at step {step}" in line[0], said
    argv = [f"model.path={run}", "rollout.kv.budget=64"]  # the command line still wins
    cfg, said = take_run_settings(load_config(argv, "eval"), argv)
    assert cfg.rollout.kv.budget == 64 and not any("auto in the run" in s for s in said), said


def test_an_auto_budget_run_without_a_saved_budget_says_it_takes_the_ceiling(tmp_path):
    from sparserl.eval.run_settings import take_run_settings

    for name, saved in (("none", {}), ("stateless", {3: None})):
        run = _auto_run(tmp_path / name, saved)
        argv = [f"model.path={run}"]
        cfg, said = take_run_settings(load_config(argv, "eval"), argv)
        assert cfg.rollout.kv.budget == 256, cfg.rollout.kv
        assert any("the controller's ceiling 256" in s for s in said), said

