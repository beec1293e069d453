"""Metrics logging, timers, RNG state and the plot script (the entry point's process set-up is
tests/process/test_entry_points.py)."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sparserl.utils.errors import UserError
from sparserl.utils.logging import MetricsLogger, format_step_line, log0, progress
from sparserl.utils.seed import rng_state, set_rng_state, set_seed
from sparserl.utils.timers import Timers

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_valid_json_with_nan_as_null(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "run", rank=0, config={"a": 1}, total_steps=3)
    logger.log(1, {"reward/mean": torch.tensor(0.5), "reward/std": 0.25, "actor/loss": float("nan"),
                   "actor/grad_norm": np.float32(2.0), "mismatch/kl": float("inf"), "kv/peak_slots": 7})
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert rows[0] == {"step": 1, "reward/mean": 0.5, "reward/std": 0.25, "actor/loss": None,
                       "actor/grad_norm": 2.0, "mismatch/kl": None, "kv/peak_slots": 7}
    assert rows[1] == {"step": 2, "reward/mean": 0.75}
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 1/3 | reward 0.500±0.25 | gnorm 2", "step 2/3 | reward 0.750"]


def test_format_step_line_uses_standard_keys():
    line = format_step_line(3, {"reward/mean": 0.3125, "reward/std": 0.41, "response/len_mean": 18.24,
                                "mismatch/kl": 1.2e-6, "correction/rejected_seq_frac": 0.05,
                                "kv/retained_frac": 0.3125, "actor/loss": -0.0131, "actor/grad_norm": 0.52,
                                "perf/step_s": 12.31, "perf/rollout_s": 8.08, "other": 1.0}, total_steps=20)
    assert line == ("step 3/20 | reward 0.312±0.41 | len 18.2 | kl(mismatch) 1.2e-06 | rejected 5.0% | "
                    "kv 31.2% | loss -0.0131 | gnorm 0.52 | 12.3 s (rollout 8.1)")
    # The evaluation row of step 0 (trainer.eval_every): its accuracy, not a bare step number.
    assert format_step_line(0, {"eval/env/avg@1": 0.9375, "eval/env/pass@1": 0.9375, "eval/time_s": 16.1},
                            total_steps=8) == "step 0/8 | eval env avg@1 0.938"


def test_tensor_metric_must_be_scalar(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, config=None, console=False)
    with pytest.raises(ValueError, match="actor/loss"):
        logger.log(1, {"actor/loss": torch.ones(2)})
    logger.close()


def test_truncate_after_drops_later_steps_and_partial_line(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, config=None, console=False)
    for step in range(1, 6):
        logger.log(step, {"reward/mean": step / 10})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # a crash mid-write
    resumed = MetricsLogger(tmp_path, rank=0, config=None, console=False)
    resumed.truncate_after(3)
    resumed.log(4, {"reward/mean": 0.99})
    resumed.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["reward/mean"] == 0.99
    cleared = MetricsLogger(tmp_path, rank=0, config=None, console=False)
    cleared.truncate_after(-1)
    cleared.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_nonzero_rank_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "run", rank=1, config=None, wandb_mode="offline")
    logger.log(1, {"reward/mean": 1.0})
    logger.truncate_after(0)
    logger.close()
    assert not (tmp_path / "run").exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_wandb_missing_warns_once_and_keeps_logging(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    logger = MetricsLogger(tmp_path, rank=0, config=None, wandb_mode="offline", console=False)
    for step in range(3):
        logger.log(step, {"reward/mean": 0.1})
    logger.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "wandb is not installed" in err[0]
    assert len(_rows(tmp_path / "metrics.jsonl")) == 3


def test_wandb_disabled_never_imports(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    MetricsLogger(tmp_path, rank=0, config=None, wandb_mode="disabled").close()
    assert capsys.readouterr().err == ""
    with pytest.raises(UserError, match="logger.wandb.mode"):
        MetricsLogger(tmp_path, rank=0, config=None, wandb_mode="offlne")


def test_wandb_receives_finite_values(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["mode"], kw["config"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, rank=0, config={"lr": 1e-6}, wandb_mode="offline", console=False)
    logger.log(5, {"reward/mean": 0.5, "actor/loss": float("nan")})
    logger.close()
    assert calls == [("init", "offline", {"lr": 1e-6}), ("log", {"reward/mean": 0.5}, 5), ("finish",)]


def test_progress_and_log0_respect_rank(monkeypatch, capsys):
    monkeypatch.setenv("SPARSERL_PROGRESS", "1")
    bar = progress(10, "rollout", rank=0)
    assert type(bar).__name__ == "tqdm"
    bar.close()
    with progress(10, "rollout", rank=1) as other:
        other.update(3)
        other.set_postfix(tok_s=1.0)
        assert type(other).__name__ != "tqdm" and other.n == 3
    monkeypatch.setenv("SPARSERL_PROGRESS", "0")
    assert type(progress(10, "x", rank=0)).__name__ != "tqdm"
    assert type(progress(10, "x", rank=0, enabled=False)).__name__ != "tqdm"
    monkeypatch.setenv("RANK", "1")
    log0("hidden")
    monkeypatch.setenv("RANK", "0")
    log0("shown")
    assert capsys.readouterr().out == "shown\n"


def test_timers_accumulate_and_reset():
    timers = Timers()
    with timers("rollout"):
        time.sleep(0.05)
    with timers("rollout"):
        time.sleep(0.05)
    with timers("train"):
        pass
    out = timers.pop()
    assert set(out) == {"perf/rollout_s", "perf/train_s"}
    assert out["perf/rollout_s"] >= 0.1
    assert out["perf/train_s"] < 0.05
    assert timers.pop() == {}


def test_timers_report_the_peak_memory_of_each_phase():
    from sparserl.utils.memory import PhasePeaks, release_free_memory

    timers = Timers(memory=PhasePeaks(torch.device("cpu"), interval_s=0.01))
    with timers("small"):
        time.sleep(0.05)
    with timers("big"):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        time.sleep(0.05)
        del x
    release_free_memory()
    out = timers.pop()
    assert out["mem/big_peak_gb"] - out["mem/small_peak_gb"] > 60 / 1024
    assert out["mem/big_end_gb"] < out["mem/big_peak_gb"] - 60 / 1024  # freed before the phase ended
    assert timers.pop() == {}


def _draws() -> tuple:
    return random.random(), np.random.rand(), torch.rand(4).tolist(), torch.randint(0, 10**6, (3,)).tolist()


def test_rng_state_roundtrip_through_torch_save(tmp_path):
    assert set_seed(7, rank=2) == 9
    _draws()
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    set_seed(123)
    assert _draws() != expected
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


def test_seed_rank_offset_gives_distinct_streams():
    set_seed(1, rank=0)
    a = _draws()
    set_seed(1, rank=1)
    b = _draws()
    set_seed(1, rank=0)
    assert _draws() == a and a != b


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synthetic_run(run_dir: Path, slope: float) -> Path:
    logger = MetricsLogger(run_dir, rank=0, config=None, console=False)
    for step in range(1, 21):
        logger.log(step, {"reward/mean": slope * step + 0.1 * math.sin(step), "actor/loss": float("nan")})
    logger.close()
    return run_dir


def test_plot_runs_writes_png(tmp_path):
    plot = _plot_module()
    runs = [_synthetic_run(tmp_path / "dense", 0.02), _synthetic_run(tmp_path / "rkv", 0.03)]
    out = plot.plot_runs(runs, "reward/mean", tmp_path / "figs" / "reward.png", labels=["dense", "rkv"], smooth=3)
    data = out.read_bytes()
    assert out == tmp_path / "figs" / "reward.png"
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert plot.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    with pytest.raises(UserError, match="actor/loss"):  # all NaN -> nothing to draw
        plot.plot_runs(runs, "actor/loss", tmp_path / "loss.png")
    with pytest.raises(UserError, match="metrics.jsonl"):
        plot.plot_runs([tmp_path / "absent"], "reward/mean", tmp_path / "x.png")
    with pytest.raises(UserError, match="reward/mean"):  # --max-step before the first step: nothing left to draw
        plot.plot_runs(runs, "reward/mean", tmp_path / "y.png", max_step=0)
    assert plot.plot_runs(runs, "reward/mean", tmp_path / "z.png", max_step=3).is_file()
