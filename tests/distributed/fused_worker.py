"""One update's loss, gradients and correction metrics, with logp_old from a separate pass or from the update's
own forward (the fused path). Used by test_fused_old_logprobs.py.

    torchrun --nproc_per_node=N tests/distributed/fused_worker.py CKPT OUT [float32|float64]
Every rank takes its contiguous share of the same 8 sequences. The sampler log-probs are the dense ones plus
noise, with a few tokens pushed far off, so the correction masks tokens, vetoes a sequence and reweights the rest.
"""
import sys

import torch
import torch.distributed as dist

from sparserl.actor.actor import Actor
from sparserl.algo import CorrectionConfig
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.loss import apply_correction, make_loss_fn
from sparserl.trainer.loss_path import FusedOldLogprobLoss
from tests.distributed.update_worker import fixed_batch

CASES = {
    "off": CorrectionConfig(enable=False),
    "kept": CorrectionConfig(enable=True, normalize_over="kept"),
    "all": CorrectionConfig(enable=True, normalize_over="all"),
    "kl_weighted": CorrectionConfig(enable=True, apply_to_kl=True),
}


def sparse_logprobs(actor: Actor, rank: int, world: int):
    """Dense log-probs of the full batch plus fixed noise, this rank's share."""
    full = fixed_batch(0, 1)
    dense = actor.logprobs(full) if world == 1 else None
    if world > 1:  # every rank computes the whole batch's dense log-probs the same way (same weights)
        dense = _gathered_dense(actor, full)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(dense.shape, generator=g) * 0.3
    noise[1, 2] = 12.0  # xi = e^-12 < 1e-4: the whole sequence is vetoed
    noise[4, 0] = -1.0  # xi = e: above token_high, masked
    noise[6, 3] = 1.0  # xi = 1/e: below token_low, masked
    sparse = (dense + noise.to(dense.dtype)) * full.mask
    share = slice(rank * len(full) // world, (rank + 1) * len(full) // world)
    return sparse[share]


def _gathered_dense(actor: Actor, full):
    return actor.logprobs(full)  # a collective on every rank, same inputs everywhere


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    info = init_distributed("cpu")
    mesh = ParallelDims.from_world(info.world_size, 1).build_mesh("cpu")
    actor = Actor(ckpt, mesh, info.device, dtype=dtype, compute_dtype=dtype, max_tokens_per_device=30)
    logp_sparse = sparse_logprobs(actor, info.rank, info.world_size)
    results = {}
    for name, corr in CASES.items():
        for agg in ("token", "sequence"):
            kl = name == "kl_weighted"
            algo = AlgoConfig(loss_agg=agg, correction=corr)
            loss_cfg = LossConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, kl_coef=0.1 if kl else 0.0)
            for path in ("separate", "fused"):
                batch = fixed_batch(info.rank, info.world_size)
                batch.logp_old, batch.weights = None, None
                batch.logp_sparse = logp_sparse.clone()
                if kl:
                    batch.logp_ref = batch.logp_sparse * 0.9  # any fixed reference
                if path == "separate":
                    batch.logp_old = actor.logprobs(batch)
                    _, metrics = apply_correction(algo, batch, actor.dp_group)
                    loss_fn = make_loss_fn(loss_cfg)
                else:
                    loss_fn = FusedOldLogprobLoss(algo, loss_cfg, actor.dp_group)
                m = actor.accumulate_gradients(batch, loss_fn, list(range(len(batch))), with_entropy=True)
                if path == "fused":
                    metrics = loss_fn.metrics
                sums = torch.tensor([m["actor/loss"], m["actor/pg_loss"], m["actor/entropy"]], dtype=torch.float64)
                dist.all_reduce(sums)
                grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
                actor.optimizer.zero_grad(set_to_none=True)
                results[(name, agg, path)] = {"loss": sums.tolist(), "grads": grads, "metrics": metrics}
    if info.rank == 0:
        torch.save(results, out)
    teardown()


if __name__ == "__main__":
    main()
