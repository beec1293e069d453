"""REINFORCE++'s advantages of one group per rank, whitened over every rank (tests/distributed/test_advantages_dist.py).

    python tests/launch.py --nproc=2 tests/distributed/advantages_worker.py OUT
Rank r takes group r of tests/unit/test_advantages.py `ragged_batch`; rank 0 saves every rank's advantages to OUT.
"""
import sys

import torch
import torch.distributed as dist

from sparserl.algo.advantages import compute_advantages
from sparserl.algo.correction import dist_reduce_sum
from sparserl.parallel import init_distributed, teardown
from tests.unit.test_advantages import ragged_batch


def main(out: str) -> None:
    info = init_distributed("cpu")
    try:
        rewards, valid, mask, token_rewards = ragged_batch()
        r, rows = info.rank, slice(3 * info.rank, 3 * info.rank + 3)  # group `rank`
        mine = {name: compute_advantages(name, rewards[r:r + 1], valid[r:r + 1], mask=mask[rows],
                                         token_rewards=token_rewards[rows], reduce_sum=dist_reduce_sum())[0]
                for name in ("reinforce_pp", "reinforce_pp_baseline")}
        parts = [None] * info.world_size
        dist.gather_object(mine, parts if info.rank == 0 else None, dst=0)
        if info.rank == 0:
            torch.save({name: torch.cat([p[name] for p in parts]) for name in mine}, out)
    finally:
        teardown()


if __name__ == "__main__":
    main(sys.argv[1])
