"""One update with and without `skip_zero_advantage` on the same weights: loss, gradients and metrics, then two
optimizer steps (the second with every advantage 0). Used by test_zero_advantage.py.

    torchrun --nproc_per_node=N tests/distributed/zero_adv_worker.py CKPT OUT
Every rank takes its contiguous share of the same 8 sequences (tests/distributed/update_worker.py `fixed_batch`), with
sequences 0 and 1 made to share a prompt. The cases set some advantages to exactly 0:
- mixed: sequences 0, 3 and 5 (0 shares its prompt with 1, whose advantage is not 0: it is trained);
- rank0_zero: sequences 0-3, all of rank 0's share with 2 processes (that rank has no backward of its own);
- all_zero: every sequence (one empty backward gives the zero gradients).
"""
import sys

import torch
import torch.distributed as dist

from sparserl.actor.actor import Actor
from sparserl.algo import CorrectionConfig
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.balance import balance_ranks
from sparserl.trainer.loss import make_loss_fn
from sparserl.trainer.loss_path import FusedOldLogprobLoss
from tests.distributed.update_worker import fixed_batch

ZERO = {"mixed": [0, 3, 5], "rank0_zero": [0, 1, 2, 3], "all_zero": list(range(8))}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_batch(case: str):
    full = fixed_batch(0, 1)
    full.ids[1][:full.prompt_lens[0]] = full.ids[0][:full.prompt_lens[0]]
    full.prompt_lens[1] = full.prompt_lens[0]
    full.advantages[ZERO[case]] = 0.0
    full.logp_old = full.weights = None
    return full


def batch_for(case: str, rank: int, world: int, logp_sparse: torch.Tensor):
    full = full_batch(case)
    share = slice(rank * len(full) // world, (rank + 1) * len(full) // world)
    return type(full)(ids=full.ids[share], prompt_lens=full.prompt_lens[share], mask=full.mask[share],
                      advantages=full.advantages[share], logp_sparse=logp_sparse[share].clone())


def loss_for(path: str, actor: Actor, batch, algo: AlgoConfig, loss_cfg: LossConfig):
    if path == "fused":
        return FusedOldLogprobLoss(algo, loss_cfg, actor.dp_group)
    batch.logp_old = actor.logprobs(batch)
    return make_loss_fn(loss_cfg)


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    mesh = ParallelDims.from_world(info.world_size, 1).build_mesh("cpu")
    kw = dict(dtype="float32", compute_dtype="float32", max_tokens_per_device=30, lr=1e-2)
    actors = {skip: Actor(ckpt, mesh, info.device, skip_zero_advantage=skip, **kw) for skip in (False, True)}
    # The sampler's log-probs: the dense ones plus noise (a collective: every rank computes the whole batch).
    dense = actors[False].logprobs(full_batch("mixed"))
    noise = torch.randn(dense.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    logp_sparse = (dense + noise) * full_batch("mixed").mask
    algo = AlgoConfig(correction=CorrectionConfig(enable=True))
    loss_cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    results = {}
    for case in ZERO:
        for path in ("separate", "fused"):
            for skip, actor in actors.items():
                batch = batch_for(case, info.rank, info.world_size, logp_sparse)
                loss_fn = loss_for(path, actor, batch, algo, loss_cfg)
                m = actor.accumulate_gradients(batch, loss_fn, list(range(len(batch))), with_entropy=True)
                sums = torch.tensor([m["actor/loss"], m["actor/pg_loss"], m["actor/entropy"],
                                     m.get("actor/no_grad_seq_frac", -1.0)], dtype=torch.float64)
                dist.all_reduce(sums)
                grads = {n: None if p.grad is None else full(p.grad).clone()
                         for n, p in actor.model.named_parameters()}
                actor.optimizer.zero_grad(set_to_none=True)
                logp_old = batch.logp_old.clone()  # this rank's share
                results[(case, path, skip)] = {"sums": sums.tolist(), "grads": grads,
                                               "metrics": getattr(loss_fn, "metrics", {}), "logp_old": logp_old}
    # Balanced by cost (2 processes): rank 0 starts with the 4 zero-advantage sequences, rank 1 with 4 to train.
    if info.world_size == 2:
        actor = actors[True]
        for weights in ((1, 1), (4, 1)):
            batch = batch_for("rank0_zero", info.rank, info.world_size, logp_sparse)
            batch, minibatches, balance = balance_ranks(batch, 1, actor.dp_group, True, weights)
            loss_fn = FusedOldLogprobLoss(algo, loss_cfg, actor.dp_group)
            actor.accumulate_gradients(batch, loss_fn, minibatches[0], with_entropy=True)
            grads = {n: full(p.grad).clone() for n, p in actor.model.named_parameters()}
            actor.optimizer.zero_grad(set_to_none=True)
            results[("balanced", weights)] = {"grads": grads, "balance": balance}
    # Two optimizer steps through update(): a mixed batch, then one whose advantages are all 0. AdamW still moves
    # the weights on the second (its first moment), so a skipped backward must leave zero gradients, not none.
    for skip, actor in actors.items():
        metrics, params = [], []
        for case in ("mixed", "all_zero"):
            batch = batch_for(case, info.rank, info.world_size, logp_sparse)
            metrics.append(actor.update(batch, FusedOldLogprobLoss(algo, loss_cfg, actor.dp_group)))
            params.append({n: full(p.detach()).clone() for n, p in actor.model.named_parameters()})
        results[("steps", skip)] = {"params": params, "metrics": metrics}
    if info.rank == 0:
        torch.save(results, out)
    teardown()


if __name__ == "__main__":
    main()
