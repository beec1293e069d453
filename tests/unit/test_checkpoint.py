"""Checkpoints: crash-safe saves (temporary folder + rename), keep_last, re-saves, and safe loading."""
from __future__ import annotations

import pickle

import pytest
import torch

from sparserl.actor import checkpoint
from sparserl.utils.errors import UserError


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(step: int) -> dict:
    return {"step": step, "scheduler": {"last_epoch": step, "base_lrs": [1e-2]}, "sampler": {"epoch": 0, "offset": step}}


def test_save_load_roundtrip_keep_last_and_leftovers(tmp_path):
    model, opt = _model_and_optimizer(0)
    root = tmp_path / "checkpoints"
    root.mkdir()
    # Leftovers of saves interrupted by a crash: never resumed from, swept by the next save.
    (root / ".step_000007.tmp").mkdir()
    (root / "step_000009").mkdir()  # no COMPLETE
    assert checkpoint.latest(tmp_path) is None
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, opt, _state(step), rank=0, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert checkpoint.latest(tmp_path) == root / "step_000003"

    fresh, fresh_opt = _model_and_optimizer(1)
    state = checkpoint.load(root / "step_000003", fresh, fresh_opt)
    assert state == _state(3)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    moments = [(s["exp_avg"], fresh_opt.state[p]["exp_avg"]) for p, s in zip(fresh.parameters(), opt.state.values())]
    assert all(torch.equal(a, b) for a, b in moments)


def test_resave_replaces_a_complete_checkpoint_only_once_the_new_one_is_complete(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = checkpoint.save(tmp_path, 5, model, opt, _state(5), rank=0)
    (path / "marker").write_text("old")
    checkpoint.save(tmp_path, 5, model, opt, {**_state(5), "again": 1}, rank=0)
    assert not (path / "marker").exists() and (path / "COMPLETE").exists()
    assert checkpoint.read_state(path)["again"] == 1
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000005"]


class _RunsCode:
    """Unpickling this calls a function of the loader's choosing: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_trainer_state_that_would_run_code_is_refused(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = checkpoint.save(tmp_path, 1, model, opt, _state(1), rank=0)
    assert checkpoint.read_state(path) == _state(1)  # a normal checkpoint loads

    marker = tmp_path / "code_ran"
    with open(path / checkpoint.STATE_FILE, "wb") as f:
        pickle.dump({"step": 1, "payload": _RunsCode(str(marker))}, f)
    with pytest.raises(UserError, match="refusing to load .*trainer_state.pt.*could run code"):
        checkpoint.load(path, *_model_and_optimizer(1))
    assert not marker.exists()
    with pytest.raises(UserError, match="refusing"):
        checkpoint.read_state(path)
    assert not marker.exists()
