"""`auto` precision across ranks: two gloo processes with different choices agree on the widest one
(the resolution rules are tests/unit/test_precision.py)."""
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from sparserl.utils import precision


def _agree_worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = precision.Choice("bfloat16", "fast here") if rank == 0 else precision.Choice("float32", "slow here")
    out[rank] = precision.agree(mine).dtype
    dist.destroy_process_group()


def test_ranks_agree_on_the_widest_choice():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_agree_worker, args=(port, out), nprocs=2)
    assert dict(out) == {0: "float32", 1: "float32"}
