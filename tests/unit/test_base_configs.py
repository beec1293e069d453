"""The base configs: configs/gpu.yaml (the Sparse-RL paper's GPU settings) composes and passes every config check on
a machine without a GPU, `--config-name` selects a base config on every entry point, and the paper's recipe
scripts start from it with their variables still working (run through a stand-in `torchrun` that prints the
resolved config instead of training)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparserl.cli import parse_cli
from sparserl.config import base_configs, load_config
from sparserl.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PAPER = {"rollout.n": 8, "rollout.max_new_tokens": 4096, "rollout.temperature": 1.0, "rollout.dtype": "bfloat16",
         "model.compute_dtype": "bfloat16", "actor.lr": 1e-6, "actor.betas": [0.9, 0.98], "actor.weight_decay": 0.1,
         "actor.updates_per_rollout": 4, "algo.kl.coef": 1e-4, "algo.kl.estimator": "k3", "algo.kl.mode": "loss",
         "algo.clip_low": 0.2, "algo.clip_high": 0.2, "algo.loss_agg": "sequence", "rollout.kv.budget": 512,
         "rollout.kv.divide_length": 128, "rollout.kv.window": 8, "rollout.kv.mix_lambda": 0.1,
         "trainer.prompts_per_step": 128, "trainer.total_steps": 100, "env.path": "envs/math.py", "data.answer_key": "label"}


def get(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_gpu_config_is_a_base_config_and_validates_without_a_gpu():
    assert {"grpo", "eval", "gpu"} <= set(base_configs())
    cfg = load_config([], config_name="gpu")  # runs every range and cross-key check
    assert cfg.rollout.kv.algorithm == "none" and not cfg.algo.correction.enable  # the mode comes from a preset
    sparse = load_config(["+preset=sparse_rl", "actor.lr=2e-6"], config_name="gpu")
    assert sparse.rollout.kv.algorithm == "rkv" and sparse.algo.correction.enable and sparse.actor.lr == 2e-6
    assert sparse.rollout.max_new_tokens == 4096 and sparse.trainer.prompts_per_step == 128


def test_cfg_job_with_config_name_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    res = subprocess.run([sys.executable, "-m", "sparserl.trainer.grpo", "--config-name", "gpu", "--cfg", "job"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = yaml.safe_load(res.stdout)
    for key, value in PAPER.items():
        assert get(cfg, key) == value, key


@pytest.mark.parametrize("option", [["--config-name", "gpu"], ["--config-name=gpu"], ["-cn", "gpu"]])
def test_config_name_forms(option, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert parse_cli(option + ["--cfg", "job", "rollout.n=4"]) is None
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rollout"]["n"] == 4 and cfg["rollout"]["max_new_tokens"] == 4096
    assert parse_cli(option + ["--help"], "eval") is None  # any entry point
    text = capsys.readouterr().out
    assert "the values shown are configs/gpu.yaml's" in text and "rollout.max_new_tokens = 4096" in text


def test_unknown_config_name_names_the_base_configs():
    with pytest.raises(UserError, match=r"--config-name gpus: no such base config; the base configs are eval, gpu, grpo"):
        parse_cli(["--config-name", "gpus"])
    with pytest.raises(UserError, match="--config-name [(]nothing[)]"):
        parse_cli(["--config-name"])


def recipe(tmp_path: Path, script: str, **env_vars: str) -> dict:
    """The config a recipe script would train with: a stand-in torchrun prints it."""
    shim = tmp_path / "bin" / "torchrun"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f'#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n[ "$1" = -m ] && shift 2\n'
                    f'exec {sys.executable} -m sparserl.trainer.grpo "$@" --cfg job\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           **env_vars}
    env.pop("RANK", None)
    res = subprocess.run(["bash", str(ROOT / "examples" / "recipes" / script), "actor.lr=3e-6"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return yaml.safe_load(res.stdout)


def test_recipes_start_from_the_gpu_config(tmp_path):
    assert "--config-name gpu" in (ROOT / "examples" / "recipes" / "paper.sh").read_text()
    cfg = recipe(tmp_path, "llama3.2-1b-instruct_sparse_rl.sh", MODEL_PATH="/ckpt/Llama-3.2-1B-Instruct")
    for key, value in {**PAPER, "actor.lr": 3e-6}.items():
        assert get(cfg, key) == value, key
    assert cfg["model"]["path"] == "/ckpt/Llama-3.2-1B-Instruct"
    assert cfg["data"]["train_path"] == str(ROOT / "data" / "train" / "simplelr_level3to5.jsonl")
    assert cfg["rollout"]["kv"]["algorithm"] == "rkv" and cfg["algo"]["correction"]["normalize_over"] == "all"
    assert cfg["trainer"]["output_dir"] == "outputs/Llama-3.2-1B-Instruct-sparse_rl"
    cfg = recipe(tmp_path, "paper.sh", MODEL_PATH="/ckpt/M", MODE="dense", DATA="mine", DATA_DIR="/data", RUN="/runs/a")
    assert cfg["rollout"]["kv"]["algorithm"] == "none" and not cfg["algo"]["correction"]["enable"]
    assert cfg["data"]["train_path"] == "/data/mine.jsonl" and cfg["trainer"]["output_dir"] == "/runs/a"
