"""The settings a checkpoint records (sparserl/trainer/resume.py): they load with weights_only=True, and a
checkpoint saved before the record existed resumes as before (the e2e side is tests/e2e/test_resume_safety.py)."""
from __future__ import annotations

import pytest
import torch

from sparserl.actor import checkpoint
from sparserl.config import Config
from sparserl.trainer import resume
from sparserl.utils.errors import UserError


def _cfg(**lora) -> Config:
    cfg = Config()
    for k, v in lora.items():
        setattr(cfg.actor.lora, k, v)
    return cfg


def _saved(tmp_path, state: dict) -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(tmp_path, 1, model, opt, {"step": 1, **state}, rank=0)
    return checkpoint.read_state(path)


def test_record_round_trips_through_a_checkpoint_and_checks_and_restores(tmp_path):
    cfg = _cfg(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    cfg.model.compute_dtype, cfg.rollout.dtype = "bfloat16", "float32"
    state = _saved(tmp_path, resume.record(cfg, consecutive_skips=2))
    assert state["settings"]["actor.lora.target_modules"] == ["q_proj", "v_proj"] and state["consecutive_skips"] == 2

    resume.check_settings(_cfg(rank=8, alpha=16.0, target_modules=["v_proj", "q_proj"]), state, "ck")  # same set
    with pytest.raises(UserError, match=r"actor\.lora\.alpha=32\.0, but the checkpoint was saved with actor\.lora\.alpha=16\.0"):
        resume.check_settings(_cfg(rank=8, alpha=32.0, target_modules=["q_proj", "v_proj"]), state, "ck")
    with pytest.raises(UserError, match=r"actor\.lora\.rank=0, but .* actor\.lora\.rank=8"):
        resume.check_settings(_cfg(rank=0), state, "ck")

    now = Config()  # both auto: the saved run's dtypes
    resume.restore_precision(now, state, "ck")
    assert (now.model.compute_dtype, now.rollout.dtype) == ("bfloat16", "float32")
    given = Config()
    given.model.compute_dtype = "float32"  # explicit: kept
    resume.restore_precision(given, state, "ck")
    assert (given.model.compute_dtype, given.rollout.dtype) == ("float32", "float32")

    class Actor:
        consecutive_skips = 0

    actor = Actor()
    resume.restore_skips(state, actor)
    assert actor.consecutive_skips == 2


def test_full_fine_tuning_ignores_the_other_adapter_settings(tmp_path):
    state = _saved(tmp_path, resume.record(_cfg(rank=0, alpha=32.0), consecutive_skips=0))
    resume.check_settings(_cfg(rank=0, alpha=4.0, dropout=0.1, target_modules=["all-linear"]), state, "ck")


def test_a_checkpoint_without_the_record_resumes_as_before(tmp_path):
    state = _saved(tmp_path, {"scheduler": {}, "sampler": {}, "world_size": 1})
    cfg = _cfg(rank=8, alpha=2.0)
    resume.check_settings(cfg, state, "ck")
    resume.restore_precision(cfg, state, "ck")
    assert (cfg.model.compute_dtype, cfg.rollout.dtype) == ("auto", "auto")  # left to the probe

    class Actor:
        consecutive_skips = 5

    actor = Actor()
    resume.restore_skips(state, actor)
    assert actor.consecutive_skips == 0
