"""Apply parallelism to a Hugging Face decoder: FSDP2 `fully_shard` per decoder layer, then the root.

Model code never imports this; plans are data. Left out on purpose (for now): tensor parallel plans,
which apply before FSDP2 on the "tp" mesh axis.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected model.model.layers (a Hugging Face decoder)")
    return list(layers)


def parallelize(model: torch.nn.Module, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
    if mesh["tp"].size() > 1:
        raise NotImplementedError("parallel.tp > 1 is not supported yet; use parallel.tp=1")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    dp = mesh["dp"]
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model
