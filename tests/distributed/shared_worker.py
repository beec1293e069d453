"""One update's loss and gradients with and without shared prompts (`actor.share_prompts`), sequences spread
over the ranks by `balance_ranks`. Used by test_shared_prompts_dist.py.

    torchrun --nproc_per_node=N tests/distributed/shared_worker.py CKPT OUT [even|skewed]
The batch: 4 prompts x 3 samples (GRPO groups), rolled out 2 prompts per rank when N = 2 (skewed: 3 and 1); the sampler
log-probs are the dense ones plus noise, so the sparsity correction masks tokens and reweights.
"""
import sys

import torch
import torch.distributed as dist

from sparserl.actor.actor import Actor, TrainBatch
from sparserl.algo import CorrectionConfig
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.balance import balance_ranks
from sparserl.trainer.loss_path import FusedOldLogprobLoss


def full_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids, plens = [], []
    for k in range(4):
        prompt = torch.randint(5, 500, (4 + 3 * k,), generator=g).tolist()
        for s in range(3):
            ids.append(prompt + torch.randint(5, 500, (2 + (5 * k + 3 * s) % 9,), generator=g).tolist())
            plens.append(len(prompt))
    T = max(len(x) - p for x, p in zip(ids, plens))
    mask = torch.zeros(len(ids), T)
    for i, (x, p) in enumerate(zip(ids, plens)):
        mask[i, : len(x) - p] = 1.0
    return TrainBatch(ids=ids, prompt_lens=plens, mask=mask, advantages=torch.randn(len(ids), generator=g))


def rows(batch: TrainBatch, index: list[int], **per_token) -> TrainBatch:
    return TrainBatch(ids=[batch.ids[i] for i in index], prompt_lens=[batch.prompt_lens[i] for i in index],
                      mask=batch.mask[index], advantages=batch.advantages[index],
                      **{k: v[index] for k, v in per_token.items()})


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    mesh = ParallelDims.from_world(info.world_size, 1).build_mesh("cpu")
    actor = Actor(ckpt, mesh, info.device, dtype="float32", compute_dtype="float32", max_tokens_per_device=40)
    full = full_batch()
    actor.share_prompts = False
    dense = actor.logprobs(full)  # every rank the whole batch: a collective with the same inputs everywhere
    g = torch.Generator().manual_seed(1)
    sparse = (dense + torch.randn(dense.shape, generator=g) * 0.3) * full.mask
    n = len(full)
    mine = list(range(info.rank * n // info.world_size, (info.rank + 1) * n // info.world_size))
    if info.world_size == 2 and len(sys.argv) > 3 and sys.argv[3] == "skewed":
        mine = list(range(9)) if info.rank == 0 else list(range(9, n))
    algo = AlgoConfig(loss_agg="token", correction=CorrectionConfig(enable=True))
    loss_cfg = LossConfig(loss_agg="token", clip_low=0.2, clip_high=0.28)
    results = {}
    for share in (False, True):
        actor.share_prompts = share
        batch = rows(full, mine, logp_sparse=sparse)
        batch, minibatches, metrics = balance_ranks(batch, 1, actor.dp_group, share_prompts=share)
        loss_fn = FusedOldLogprobLoss(algo, loss_cfg, actor.dp_group)
        m = actor.accumulate_gradients(batch, loss_fn, minibatches[0], with_entropy=True)
        sums = torch.tensor([m["actor/loss"], m["actor/entropy"]], dtype=torch.float64)
        dist.all_reduce(sums)
        # every group on one rank with sharing: gather which prompts each rank trained on
        prompts = [sorted({tuple(batch.ids[i][: batch.prompt_lens[i]]) for i in minibatches[0]})]
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, prompts[0])
        grads = {k: p.grad.full_tensor().clone() for k, p in actor.model.named_parameters()}
        actor.optimizer.zero_grad(set_to_none=True)
        results[share] = {"loss": sums.tolist(), "grads": grads, "metrics": {**metrics, **loss_fn.metrics},
                          "prompts_per_rank": [len(p) for p in everyone],
                          "microbatches": len(actor._microbatches(batch, minibatches[0]))}
    if info.rank == 0:
        torch.save(results, out)
    teardown()


if __name__ == "__main__":
    main()
