"""Process groups, devices and the device mesh. Nothing else in sparserl builds process groups.

`ParallelDims(dp, tp, cp)` validates the layout and owns the `("dp", "cp", "tp")` DeviceMesh (with `"dp_cp"`, the
flattened dp x cp mesh FSDP2 shards over, when cp > 1) and the gloo side groups over which the first rank of each
data-parallel rank's cp x tp ranks hands its rollouts to the others (`ReplicaGroup`). `init_distributed`
works under torchrun (any number of nodes) and as a plain `python` process (a world of one), picking gloo on
CPU and nccl on CUDA. Context parallelism (cp) splits each packed micro-batch along the sequence
(actor/context_parallel.py, docs/context_parallel.md).
Hybrid sharding (`dp_replicate` > 1, RL2's `ddp_size`): the dp ranks form dp_replicate replicas of dp_shard =
dp / dp_replicate ranks each. The mesh is then ("dp_replicate", "dp_shard", "cp", "tp"), row-major, so a replica
is consecutive ranks (one node, where a node holds a replica); "dp" is the flattened replicas x shards (the data
axis every other part reads) and FSDP2 gets the 2-D ("dp_replicate", "dp_shard" [x cp]) mesh: parameters are
sharded within a replica and replicated across replicas, so the gradient's reduce-scatter stays inside a replica
and only the sharded gradients are all-reduced across them. Left out on purpose: pipeline and expert parallelism.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparserl.utils.errors import UserError


@dataclass
class ParallelDims:
    dp: int
    tp: int = 1
    cp: int = 1  # context parallel: ranks that split one packed row along the sequence (inside dp, outside tp)
    dp_replicate: int = 1  # hybrid sharding: replicas of the sharded model among the dp ranks (dividing dp)

    @classmethod
    def from_world(cls, world_size: int, tp: int, cp: int = 1, dp_replicate: int = 1) -> "ParallelDims":
        if tp < 1 or world_size % tp:
            raise UserError(f"parallel.tp={tp} must divide the world size {world_size}")
        if cp < 1 or world_size % (tp * cp):
            raise UserError(f"parallel.cp={cp} x parallel.tp={tp} must divide the world size {world_size}")
        dp = world_size // (tp * cp)
        if dp_replicate < 1 or dp % dp_replicate:
            raise UserError(f"parallel.dp_replicate={dp_replicate} must divide the data-parallel size {dp} (world size "
                            f"{world_size} / (tp {tp} x cp {cp}))")
        return cls(dp=dp, tp=tp, cp=cp, dp_replicate=dp_replicate)

    def validate_model(self, config) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if kv % self.tp or text.num_attention_heads % self.tp:
            raise UserError(f"parallel.tp={self.tp} must divide the model's attention heads ({text.num_attention_heads}) and KV heads ({kv})")

    def build_mesh(self, device_type: str):
        """The ("dp", "cp", "tp") mesh, row-major: the cp x tp ranks of one DP rank are consecutive, a TP group is
        `tp` consecutive ranks. With cp > 1 it also holds "dp_cp", the flattened dp x cp mesh FSDP2 shards over."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_replicate > 1:  # hybrid sharding: see the module docstring
            shape = (self.dp_replicate, self.dp // self.dp_replicate, self.cp, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            if self.cp > 1:
                mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            return mesh
        mesh = init_device_mesh(device_type, (self.dp, self.cp, self.tp), mesh_dim_names=("dp", "cp", "tp"))
        if self.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")
        return mesh

    def replica_group(self, rank: int) -> "ReplicaGroup":
        """This rank's `ReplicaGroup`: the cp x tp ranks of its DP rank, which train on the same samples. Builds a gloo
        side group per DP rank: every rank must call it, once, at the same point (each `new_group` is a collective
        over the world, called for all groups in one order)."""
        size = self.cp * self.tp  # the mesh is (dp, cp, tp), row-major: one DP rank's ranks are consecutive
        owner = rank - rank % size
        if size == 1:
            return ReplicaGroup(rank, owner, None)
        mine = None
        for first in range(0, self.dp * size, size):
            group = dist.new_group(list(range(first, first + size)), backend="gloo", timeout=SHARE_TIMEOUT)
            if first == owner:
                mine = group
        return ReplicaGroup(rank, owner, mine)


def cp_size(mesh) -> int:
    """The mesh's context-parallel size (1 for a mesh without a "cp" axis)."""
    return mesh["cp"].size() if "cp" in (mesh.mesh_dim_names or ()) else 1


def fsdp_mesh(mesh):
    """The mesh FSDP2 shards parameters over: dp, or the flattened dp x cp when cp > 1 (the cp ranks of a DP rank
    hold the same parameters and each computes a part of the same micro-batch's gradient); with hybrid sharding
    the 2-D (dp_replicate, dp_shard [x cp]) mesh, on which FSDP2 replicates over the first axis."""
    cp = cp_size(mesh) > 1
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard_cp" if cp else "dp_shard"]
    return mesh["dp_cp"] if cp else mesh["dp"]


# A peer waits in `ReplicaGroup.from_owner` for as long as the owner's rollout takes, which can be hours; a crashed
# owner still ends the job, through torchrun.
SHARE_TIMEOUT = datetime.timedelta(hours=24)


@dataclass
class ReplicaGroup:
    """One DP rank's one source of rollouts: of its cp x tp ranks (a tensor-parallel group, or several with context
    parallelism), the owner (first rank) runs the engine and the env loop, its peers receive the owner's results,
    so every rank of the group trains on the same samples even where
    an env's results depend on the process (its rank, a clock, a remote service). The objects go over a gloo
    side group, pickled, on the CPU: a waiting peer does not spin on a device that the owner's engine uses."""

    rank: int
    owner: int
    group: object | None  # gloo ProcessGroup over the DP rank's cp x tp ranks; None when cp == tp == 1

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    def from_owner(self, obj=None):
        """The owner's `obj` on every rank of the group: the owner passes it, the peers pass nothing and get it."""
        if self.group is None:
            return obj
        box = [obj if self.is_owner else None]
        dist.broadcast_object_list(box, src=self.owner, group=self.group, device=torch.device("cpu"))
        return box[0]


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def choose_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("parallel.device=cuda but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise UserError(f"parallel.device={device!r}: choose auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Initialize the default process group (a world of one when not launched by torchrun)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = choose_device(device, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        if "RANK" not in os.environ:
            # A world of one needs no rendezvous: an in-process store, so no TCP port is taken, and the process's
            # environment is left as it was (a child process it starts must not inherit a RANK or a MASTER_PORT that
            # is this process's: its own world of one would then try to bind this process's port).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
