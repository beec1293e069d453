"""`auto` precision: the resolution rules, the thread count, and what the trainer writes (the ranks' agreement is
tests/distributed/test_precision_agree.py)."""
import os

import pytest
import torch

from sparserl.config.load import load_config
from sparserl.utils.precision import resolve_precision
from sparserl.utils import precision


def test_cpu_without_native_bf16_is_fp32():
    c = precision.choose_auto("cpu", native_bf16=False)
    assert c.dtype == "float32" and "no native bf16" in c.reason


def test_cpu_with_native_bf16_follows_the_probe():
    assert precision.choose_auto("cpu", native_bf16=True, speedup=1.9).dtype == "bfloat16"
    slow = precision.choose_auto("cpu", native_bf16=True, speedup=0.3)
    assert slow.dtype == "float32" and "0.30x" in slow.reason


def test_this_cpu_resolves_consistently():
    # On this machine, whatever it is: native bf16 absent means fp32, present means the probe decides.
    c = precision.choose_auto("cpu")
    if not precision.cpu_has_native_bf16():
        assert c.dtype == "float32"
    assert c.dtype in ("float32", "bfloat16")
    assert precision.probe_cpu_bf16_speedup() > 0


@pytest.mark.parametrize("supported,expected", [(True, "bfloat16"), (False, "float32")])
def test_cuda_follows_the_device(monkeypatch, supported, expected):
    # No GPU here: the driver's answers are the only thing replaced.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "GPU-X")
    c = precision.choose_auto(torch.device("cuda", 0))
    assert c.dtype == expected and "GPU-X" in c.reason
    assert c.dtype != "float16"  # never chosen automatically


def test_explicit_values_win(monkeypatch):
    monkeypatch.setattr(precision, "choose_auto", lambda device: precision.Choice("float32", "test"))
    cfg = load_config(["model.compute_dtype=bfloat16", "rollout.dtype=auto"])
    resolve_precision(cfg, torch.device("cpu"))
    assert (cfg.model.compute_dtype, cfg.rollout.dtype) == ("bfloat16", "float32")
    cfg = load_config(["model.compute_dtype=float16", "rollout.dtype=float32"])
    resolve_precision(cfg, torch.device("cpu"))
    assert (cfg.model.compute_dtype, cfg.rollout.dtype) == ("float16", "float32")


def test_defaults_are_auto_and_resolve_to_concrete_dtypes(monkeypatch):
    choice = precision.choose_auto("cpu")  # the probe once: two probes on a loaded machine may disagree
    assert choice.dtype in ("bfloat16", "float32")
    monkeypatch.setattr(precision, "choose_auto", lambda device: choice)
    cfg = load_config([])
    assert cfg.model.compute_dtype == cfg.rollout.dtype == "auto"
    resolve_precision(cfg, torch.device("cpu"))
    assert cfg.model.compute_dtype == cfg.rollout.dtype == choice.dtype


def test_threads(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert precision.cpu_threads(local_world_size=1) == 1  # the user's own 1
    assert precision.cpu_threads(local_world_size=2) == max(1, cores // 2)  # torchrun's default 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert precision.cpu_threads(local_world_size=2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert precision.cpu_threads(local_world_size=1) == cores
