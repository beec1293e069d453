"""Worker of tests/distributed/test_critic_dist.py: one critic update on a fixed batch.

    [torchrun --nproc_per_node=DP*TP*CP] critic_worker.py OUT CKPT DP TP CP
Every DP rank takes its contiguous share of the same 8 sequences (groups sharing a prompt, an env token); the cp and
tp ranks of a DP rank hold the same ones. Rank 0 saves every rank's values before the update, the update's metrics
and the critic's full weights after it.
"""
import sys

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.actor.critic import Critic
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.critic import value_loss_fn

N, T = 8, 9


def fixed_batch(share: int, shares: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (p,), generator=g).tolist() for p in (5, 3)]
    ids, plens, mask = [], [], torch.zeros(N, T)
    for i in range(N):
        prompt = prompts[i // 2] if i < 4 else torch.randint(5, 250, (2 + i % 3,), generator=g).tolist()
        r = 2 + (3 * i) % (T - 1)
        ids.append(prompt + torch.randint(5, 250, (r,), generator=g).tolist())
        plens.append(len(prompt))
        mask[i, :r] = 1.0
    mask[1, 1] = 0.0
    returns = torch.randn(N, T, generator=g) * mask
    s = slice(share * N // shares, (share + 1) * N // shares)
    return TrainBatch(ids=ids[s], prompt_lens=plens[s], mask=mask[s], advantages=torch.zeros(N, T)[s],
                      returns=returns[s])


def main(out: str, ckpt: str, dp: int, tp: int, cp: int) -> None:
    info = init_distributed("cpu")
    dims = ParallelDims.from_world(info.world_size, tp, cp)
    mesh = dims.build_mesh("cpu")
    critic = Critic(ckpt, mesh, info.device, dtype="float32", compute_dtype="float32", lr=1e-2,
                    max_tokens_per_device=40, seed=3)
    batch = fixed_batch(mesh["dp"].get_local_rank(), dp)
    batch.values = critic.values(batch)
    metrics = critic.update(batch, value_loss_fn(0.2, "token"), 1, 2)  # two epochs: the second one clips
    values = [None] * info.world_size
    dist.all_gather_object(values, (mesh["dp"].get_local_rank(), batch.values))
    state = {name: t.clone() for name, t in critic.full_state()}
    if info.rank == 0:
        torch.save({"values": values, "metrics": metrics, "state": state}, out)
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
