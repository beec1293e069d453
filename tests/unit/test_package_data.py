"""The data ships with the project: the named eval sets are package data (in the wheel, resolved inside the
installed package) and the training sets are in the repository, so a clone or a wheel needs nothing beside it.

The wheel is built from a copy of setup.py, README.md, sparserl/, configs/ and envs/ in a temporary folder, so the
test leaves no build/ or egg-info in the checkout. The base configs and the built-in envs ship in the wheel too
(sparserl/configs, sparserl/envs), so an installed package runs its defaults with no checkout beside it
(scripts/check_wheel.sh runs one).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import sparserl
from sparserl.config import EvalConfig
from sparserl.eval.datasets import DEFAULT_DATA_DIR, SHARED, load_eval_sets, resolve_spec
from sparserl.utils.errors import UserError
from tests.conftest import EVAL_DATA, TRAIN_DATA

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(sparserl.__file__).resolve().parent
EVAL_FILES = sorted(spec.path for spec in SHARED.values())


def test_every_named_set_resolves_inside_the_package():
    assert DEFAULT_DATA_DIR == PACKAGE / "data" / "eval" == EVAL_DATA
    for i, name in enumerate(SHARED):
        path = Path(resolve_spec(name, i, DEFAULT_DATA_DIR).path)
        assert path.is_relative_to(PACKAGE) and path.is_file(), path
        assert "shared" not in path.relative_to(PACKAGE).parts
    assert sorted(p.name for p in EVAL_DATA.glob("*.jsonl")) == EVAL_FILES
    assert (EVAL_DATA / "README.md").is_file()


def test_data_dir_and_explicit_paths_resolve_as_given(tmp_path):
    assert resolve_spec("gsm8k", 0, tmp_path).path == str(tmp_path / "gsm8k.jsonl")
    mine = {"name": "gsm8k", "path": "some/where.jsonl"}
    assert resolve_spec(mine, 0, DEFAULT_DATA_DIR).path == "some/where.jsonl"
    with pytest.raises(UserError, match=re.escape(f"no such file {tmp_path / 'mawps.jsonl'}")):
        load_eval_sets(EvalConfig(datasets=["mawps"], data_dir=str(tmp_path)))


def test_training_sets_are_in_the_repository():
    names = sorted(p.name for p in TRAIN_DATA.glob("*.jsonl"))
    assert names == ["simplelr_level3to5.jsonl", "simplelr_qwen_level3to5.jsonl"]
    assert (TRAIN_DATA / "README.md").is_file()
    recipe = (ROOT / "examples" / "recipes" / "paper.sh").read_text()
    assert '/../.." && pwd)/data/train' in recipe
