"""Process groups, devices and the device mesh. Nothing else in sparserl builds process groups.

`ParallelDims(dp, tp)` validates the layout and owns the `("dp", "tp")` DeviceMesh. `init_distributed` works
under torchrun (any number of nodes) and as a plain `python` process (a world of one), picking gloo on CPU
and nccl on CUDA. Left out on purpose: pipeline and context parallelism, expert parallelism.
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

    @classmethod
    def from_world(cls, world_size: int, tp: int) -> "ParallelDims":
        if tp < 1 or world_size % tp:
            raise UserError(f"parallel.tp={tp} must divide the world size {world_size}")
        return cls(dp=world_size // tp, tp=tp)

    def validate_model(self, config) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if kv % self.tp or text.num_attention_heads % self.tp:
            raise UserError(f"parallel.tp={self.tp} must divide the model's attention heads ({text.num_attention_heads}) and KV heads ({kv})")

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


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
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
