"""The wheel holds the named eval sets (package data, byte for byte), the base configs and the built-in envs
(as sparserl/configs and sparserl/envs) and every module, and not the training sets. It is built with pip, in a
fresh process, from a copy of setup.py, README.md, sparserl/, configs/ and envs/ in a temporary folder, so the
test leaves no build/ or egg-info in the checkout (tests/unit/test_package_data.py resolves the sets in place)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sparserl
from tests.conftest import EVAL_DATA
from tests.unit.test_package_data import EVAL_FILES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(sparserl.__file__).resolve().parent


@pytest.mark.timeout(180)
def test_the_wheel_holds_the_eval_sets(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("sparserl", "configs", "envs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
           "-w", str(tmp_path / "dist"), str(src)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("sparserl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for file in EVAL_FILES:
            member = f"sparserl/data/eval/{file}"
            assert member in names, member
            assert zf.read(member) == (EVAL_DATA / file).read_bytes(), member
        for folder in ("configs", "envs"):  # as sparserl/configs and sparserl/envs
            for path in (ROOT / folder).rglob("*"):
                if path.suffix in (".yaml", ".py"):
                    member = f"sparserl/{folder}/{path.relative_to(ROOT / folder).as_posix()}"
                    assert member in names and zf.read(member) == path.read_bytes(), member
    assert "sparserl/data/eval/README.md" in names
    for module in PACKAGE.rglob("*.py"):  # every module, so `python -m sparserl.eval` runs from an installed wheel
        assert f"sparserl/{module.relative_to(PACKAGE).as_posix()}" in names, module
    assert not any("simplelr" in n for n in names)  # the training sets stay in the repository
