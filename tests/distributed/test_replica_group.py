"""`ParallelDims.replica_group`: the owner of each data-parallel replica's cp x tp ranks (its first rank; with cp = 1
the tensor-parallel group's) hands objects to its own peers, over gloo.

Four real processes (gloo) in the (dp, tp) = (2, 2) layout and in (4, 1): the side groups are the TP groups
of the mesh (consecutive ranks), each peer receives its own owner's object and no other, a group's objects
do not leak into the next call, and with tp = 1 there is no side group and the object comes back as is.
"""
import pickle

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, tp: int, init: str, out: str, cp: int = 1) -> None:
    from sparserl.parallel import ParallelDims

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        dims = ParallelDims.from_world(world, tp, cp)
        mesh = dims.build_mesh("cpu")
        replica = dims.replica_group(rank)
        seen = []
        for call in range(3):
            # Only the owner's object is real; a peer passes its own, which must be ignored.
            mine = {"from": rank, "call": call, "payload": list(range(rank * 10 + call))}
            seen.append(replica.from_owner(mine if replica.is_owner else {"from": rank, "peer": True}))
        result = {"owner": replica.owner, "is_owner": replica.is_owner, "seen": seen,
                  "group": None if replica.group is None else (dist.get_backend(replica.group),
                                                             dist.get_process_group_ranks(replica.group)),
                  "mesh_tp": dist.get_process_group_ranks(mesh["tp"].get_group()) if tp > 1 else None,
                  "mesh_cp": dist.get_process_group_ranks(mesh["cp"].get_group()) if cp > 1 else None,
                  "passthrough": replica.from_owner(mine) is mine}
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 1])
def test_each_peer_gets_its_owners_objects(tmp_path, tp):
    world = 4
    init, out = f"file://{tmp_path / 'store'}", str(tmp_path / "result")
    mp.spawn(_worker, args=(world, tp, init, out), nprocs=world, join=True)
    results = [pickle.loads(open(f"{out}.{r}", "rb").read()) for r in range(world)]
    for rank, r in enumerate(results):
        owner = rank - rank % tp
        assert r["owner"] == owner and r["is_owner"] == (rank == owner)
        assert [s["from"] for s in r["seen"]] == [owner] * 3, r["seen"]
        assert [s["call"] for s in r["seen"]] == [0, 1, 2]
        assert r["seen"][2]["payload"] == list(range(owner * 10 + 2))
        if tp == 1:
            assert r["group"] is None and r["passthrough"]
        else:
            backend, ranks = r["group"]
            assert backend == "gloo" and ranks == list(range(owner, owner + tp)) == r["mesh_tp"]


@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2)])
def test_context_parallel_peers_share_their_dp_ranks_owner(tmp_path, tp, cp):
    """With cp > 1 the side group is a DP rank's cp x tp consecutive ranks, which hold the mesh's cp groups."""
    world = 4
    init, out = f"file://{tmp_path / 'store'}", str(tmp_path / "result")
    mp.spawn(_worker, args=(world, tp, init, out, cp), nprocs=world, join=True)
    results = [pickle.loads(open(f"{out}.{r}", "rb").read()) for r in range(world)]
    size = tp * cp
    for rank, r in enumerate(results):
        owner = rank - rank % size
        assert r["owner"] == owner and r["is_owner"] == (rank == owner)
        assert [s["from"] for s in r["seen"]] == [owner] * 3, r["seen"]
        backend, ranks = r["group"]
        assert backend == "gloo" and ranks == list(range(owner, owner + size))
        assert set(r["mesh_cp"]) <= set(ranks) and len(r["mesh_cp"]) == cp and rank in r["mesh_cp"]
