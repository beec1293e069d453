"""One update's loss and gradients do not depend on the number of processes, micro-batches, activation
checkpointing or moving sequences between ranks to balance their token loads (fp32)."""
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.launch import command

WORKER = Path(__file__).with_name("update_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run(ckpt, out, max_tokens, nproc, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = command(nproc, WORKER, ckpt, out, max_tokens, *extra)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]


def test_update_invariance(tiny_checkpoint, tmp_path):
    run(tiny_checkpoint, tmp_path / "one", 10_000, 1)
    run(tiny_checkpoint, tmp_path / "four", 25, 1)  # 4 micro-batches
    run(tiny_checkpoint, tmp_path / "two", 10_000, 2)
    run(tiny_checkpoint, tmp_path / "ac", 25, 1, "ac")  # activation checkpointing recomputes inside backward
    run(tiny_checkpoint, tmp_path / "balanced", 10_000, 2, "balance")  # 6 + 2 sequences, then balanced
    for agg in ("token", "sequence"):
        ref = torch.load(tmp_path / f"one.{agg}.pt")
        assert ref["microbatches"] == 1
        bal = torch.load(tmp_path / f"balanced.{agg}.pt")["balance"]
        # lengths 7 11 15 10 10 14 | 9 13: 67 vs 22 tokens before; the partition gives 44 / 45
        assert bal["perf/dp_load_imbalance_before"] == pytest.approx(67 / 44.5)
        assert sorted(bal["loads"]) == [44.0, 45.0]
        assert bal["perf/dp_load_imbalance"] == pytest.approx(45 / 44.5)
        for other in ("four", "two", "ac", "balanced"):
            got = torch.load(tmp_path / f"{other}.{agg}.pt")
            if other == "four":
                assert got["microbatches"] == 4
            assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"]), (agg, other, got["loss"], ref["loss"])
            for name, g in ref["grads"].items():
                diff = (got["grads"][name] - g).norm() / g.norm().clamp(min=1e-12)
                assert diff < 1e-6 or (got["grads"][name] - g).abs().max() < 1e-9, (agg, other, name, float(diff))
            assert any(g.abs().sum() > 0 for g in ref["grads"].values())


def test_hybrid_sharding_update_equals_one_shard_group(tiny_checkpoint, tmp_path):
    """parallel.dp_replicate=2 on 4 processes (2 replicas x 2 shards: FSDP2 on a 2-D mesh, replicated over the
    first axis) gives the loss and gradients of dp=4 in one shard group, to 1e-5 (fp32, gloo)."""
    run(tiny_checkpoint, tmp_path / "dp4", 10_000, 4)
    run(tiny_checkpoint, tmp_path / "hsdp", 10_000, 4, "hsdp")
    for agg in ("token", "sequence"):
        ref, got = torch.load(tmp_path / f"dp4.{agg}.pt"), torch.load(tmp_path / f"hsdp.{agg}.pt")
        assert ref["layout"] == {"placements": ["S(0)"], "mesh": ["dp"]}, ref["layout"]
        assert got["layout"] == {"placements": ["R", "S(0)"], "mesh": ["dp_replicate", "dp_shard"]}, \
            got["layout"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for name, g in ref["grads"].items():
            assert (got["grads"][name] - g).abs().max() <= 1e-5 * g.abs().max().clamp(min=1e-12), (agg, name)
        assert any(g.abs().sum() > 0 for g in ref["grads"].values())
