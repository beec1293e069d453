"""The batch renormalization and the metrics of `correct` are the same on 1 and 2 processes (gloo, CPU), with the
weights normalized over the kept tokens or over every response token (the reference recipe's choice)."""
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparserl.algo.aggregation import count_normalizer
from sparserl.algo.correction import correct, dist_reduce_sum
from sparserl.algo.correction_config import CorrectionConfig

import dataclasses

CFG = CorrectionConfig(token_high=None, geo_low=0.5, geo_high=2.0)


def _batch():
    g = torch.Generator().manual_seed(1234)
    B, T = 8, 16
    logp_sparse = -3 * torch.rand(B, T, generator=g)
    logp_old = logp_sparse + 0.4 * torch.randn(B, T, generator=g)
    logp_old[1, 3] = logp_sparse[1, 3] - 12.0  # vetoed sequence on rank 0
    logp_old[5, :] += 0.8  # rank 1 gets larger ratios: many capped weights, a different local mean
    mask = (torch.arange(T)[None] < torch.randint(4, T + 1, (B, 1), generator=g)).float()
    return logp_old, logp_sparse, mask


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, normalize_over):
    cfg = dataclasses.replace(CFG, normalize_over=normalize_over)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logp_old, logp_sparse, mask = (t.chunk(world)[rank] for t in _batch())
        reduce = dist_reduce_sum()
        corr, metrics = correct(cfg, logp_old, logp_sparse, mask, reduce_sum=reduce)
        local, _ = correct(cfg, logp_old, logp_sparse, mask)  # no reduction: this rank only
        norm = count_normalizer([corr.mask], reduce_sum=reduce)
        torch.save({"weights": corr.weights, "mask": corr.mask, "rejected": corr.seq_rejected,
                    "metrics": metrics, "local_weights": local.weights, "norm": norm},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("normalize_over", ["kept", "all"])
def test_renormalization_matches_single_process(normalize_over):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(2, _free_port(), out_dir, normalize_over), nprocs=2, join=True)
        parts = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]

    full, metrics = correct(dataclasses.replace(CFG, normalize_over=normalize_over), *_batch())
    weights = torch.cat([p["weights"] for p in parts])
    torch.testing.assert_close(weights, full.weights, rtol=0, atol=1e-6)
    assert torch.equal(torch.cat([p["mask"] for p in parts]), full.mask)
    assert torch.equal(torch.cat([p["rejected"] for p in parts]), full.seq_rejected)
    assert full.seq_rejected.any() and metrics["correction/truncated_frac"] > 0
    for p in parts:
        assert p["metrics"].keys() == metrics.keys()
        for k, v in metrics.items():
            assert p["metrics"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert parts[0]["norm"].tokens == full.mask.sum().item() and parts[1]["norm"].seqs == 8.0
    # the test can tell: renormalizing with each rank's own mean gives different weights
    local = torch.cat([p["local_weights"] for p in parts])
    assert (local - full.weights).abs().max().item() > 1e-3
    assert all(p["norm"].tokens == full.kept_tokens for p in parts)
