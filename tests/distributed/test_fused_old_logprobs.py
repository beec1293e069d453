"""The fused path (logp_old from the update's own forward, correction normalizers applied to the
accumulated gradient) gives the same loss, gradients and correction metrics as a separate old-log-prob pass,
with and without the correction, in 1 and 2 processes (fp32)."""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.launch import command

WORKER = Path(__file__).with_name("fused_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run(ckpt, out, nproc, dtype="float32", worker=WORKER):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [str(worker), str(ckpt), str(out), dtype]
    cmd = command(nproc, *args)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def whole(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


@pytest.mark.slow
def test_fused_matches_separate_pass(tiny_checkpoint, tmp_path):
    one = run(tiny_checkpoint, tmp_path / "one.pt", 1)
    two = run(tiny_checkpoint, tmp_path / "two.pt", 2)
    ref0 = one[("kept", "token", "separate")]["metrics"]
    # The noise does what it should: a vetoed sequence, masked tokens, weights renormalized.
    assert ref0["correction/veto_seq_frac"] == pytest.approx(1 / 8)
    assert ref0["correction/masked_low_frac"] > 0 and ref0["correction/masked_high_frac"] > 0
    assert ref0["correction/norm_factor"] != pytest.approx(1.0, abs=1e-3)
    assert one[("all", "token", "separate")]["metrics"]["correction/norm_factor"] != pytest.approx(ref0["correction/norm_factor"], abs=1e-4)
    for (name, agg, path), got in list(one.items()) + [(k, v) for k, v in two.items()]:
        ref = one[(name, agg, "separate")]
        for a, b in zip(got["loss"], ref["loss"]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (name, agg, path, got["loss"], ref["loss"])
        # fp32: the normalizer is applied per token on one path and to the summed gradient on the other, so the
        # rounding differs: whole gradient within 1e-6 relative, each parameter within 3e-6 (cancellation).
        assert rel(whole(got["grads"]), whole(ref["grads"])) < 1e-6, (name, agg, path)
        for n, g in ref["grads"].items():
            assert rel(got["grads"][n], g) < 3e-6, (name, agg, path, n, rel(got["grads"][n], g))
        for key, v in ref["metrics"].items():
            assert got["metrics"][key] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, agg, path, key)
    for agg in ("token", "sequence"):  # without the correction nothing is normalized afterwards: bit for bit
        fused, sep = one[("off", agg, "fused")]["grads"], one[("off", agg, "separate")]["grads"]
        assert all(torch.equal(fused[n], g) for n, g in sep.items())
    assert any(g.abs().sum() > 0 for g in one[("kept", "token", "fused")]["grads"].values())
    # The correction changes the gradient (otherwise the comparison above would prove little).
    off, on = one[("off", "token", "fused")]["grads"], one[("kept", "token", "fused")]["grads"]
    assert max(rel(on[n], off[n]) for n in off) > 1e-2

