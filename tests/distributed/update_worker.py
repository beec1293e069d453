"""Run one update's forward/backward on a fixed batch and save loss + full gradients (used by the tests).

    torchrun --nproc_per_node=N tests/distributed/update_worker.py CKPT OUT MAX_TOKENS [ac|balance|hsdp]
Every rank takes its contiguous share of the same 8 sequences. With `balance` (2 ranks), rank 0 starts with
6 of them and rank 1 with 2, and `balance_ranks` evens out the token loads before the update. With `hsdp` the dp
ranks form 2 replicas (`parallel.dp_replicate=2`); the worker also records a parameter's placements and mesh.
"""
import sys

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.algo.loss import LossConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.balance import balance_ranks
from sparserl.trainer.loss import make_loss_fn
from sparserl.actor.actor import Actor


def fixed_batch(rank: int, world: int, skewed: bool = False) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    n, T = 8, 12
    ids, plens, masks = [], [], []
    for i in range(n):
        p, r = 3 + i % 4, 4 + (3 * i) % 9
        ids.append(torch.randint(5, 500, (p + r,), generator=g).tolist())
        plens.append(p)
        m = torch.zeros(T)
        m[:r] = 1.0
        masks.append(m)
    mask = torch.stack(masks)
    mask[2, 1] = 0.0  # an env token inside a response
    adv = torch.randn(n, generator=g)
    logp_old = -torch.rand(n, T, generator=g) * 3
    share = slice(rank * n // world, (rank + 1) * n // world)
    if skewed:
        share = slice(0, 6) if rank == 0 else slice(6, n)
    return TrainBatch(ids=ids[share], prompt_lens=plens[share], mask=mask[share], advantages=adv[share],
                      logp_old=logp_old[share], weights=(0.5 + torch.rand(n, T, generator=g))[share])


def main() -> None:
    ckpt, out, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    checkpointing = mode == "ac"
    info = init_distributed("cpu")
    mesh = ParallelDims.from_world(info.world_size, 1, dp_replicate=2 if mode == "hsdp" else 1).build_mesh("cpu")
    actor = Actor(ckpt, mesh, info.device, dtype="float32", compute_dtype="float32", max_tokens_per_device=max_tokens,
                  activation_checkpointing=checkpointing)
    batch = fixed_batch(info.rank, info.world_size, skewed=mode == "balance")
    balance = {}
    if mode == "balance":
        batch, minibatches, balance = balance_ranks(batch, 1, actor.dp_group)
        assert minibatches == [list(range(len(batch)))]
        load = torch.tensor([float(sum(batch.lengths()))])
        loads = [torch.zeros(1) for _ in range(info.world_size)]
        dist.all_gather(loads, load)
        balance["loads"] = [float(x) for x in loads]
    for agg in ("token", "sequence"):
        cfg = LossConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28)
        metrics = actor.accumulate_gradients(batch, make_loss_fn(cfg), list(range(len(batch))), with_entropy=True)
        loss = torch.tensor([metrics["actor/loss"]], dtype=torch.float64)
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        first = next(actor.model.parameters())
        layout = {"placements": [str(x) for x in first.placements], "mesh": list(first.device_mesh.mesh_dim_names)}
        actor.optimizer.zero_grad(set_to_none=True)
        n_mb = len(actor._microbatches(batch, list(range(len(batch)))))  # a collective: every rank calls it
        if info.rank == 0:
            torch.save({"loss": float(loss), "grads": grads, "microbatches": n_mb, "balance": balance, "layout": layout},
                       f"{out}.{agg}.pt")
    teardown()


if __name__ == "__main__":
    main()
