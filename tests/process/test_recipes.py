"""The base config and the recipe scripts from the command line, in fresh processes: `--config-name gpu --cfg job`
prints the Sparse-RL paper's settings, and the paper's recipe scripts start from configs/gpu.yaml with their
variables still working (run through a stand-in `torchrun` that prints the resolved config instead of training).
The in-process checks of the base configs are tests/unit/test_base_configs.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.unit.test_base_configs import PAPER, get

ROOT = Path(__file__).resolve().parents[2]


def test_cfg_job_with_config_name_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    res = subprocess.run([sys.executable, "-m", "sparserl.trainer.grpo", "--config-name", "gpu", "--cfg", "job"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = yaml.safe_load(res.stdout)
    for key, value in PAPER.items():
        assert get(cfg, key) == value, key


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
