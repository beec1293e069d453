"""Apply parallelism to a Hugging Face decoder: the tensor-parallel plan on "tp", then FSDP2 on "dp".

Tensor parallelism comes first (tp_plans.py says which module is split how); afterwards every parameter is
a DTensor on the tp mesh, and FSDP2 `fully_shard` (per decoder layer, then the root) shards those over dp,
giving 2-D (dp, tp) parameters. With context parallelism FSDP2 shards over the flattened dp x cp mesh ("dp_cp"),
as torchtitan does: the cp ranks of a DP rank hold the same parameters, and the gradient reduce-scatter sums the
parts of one micro-batch's gradient that each of them computed. With the LM head split by vocabulary, the model's logits are each rank's
(N, V/tp) slice; the vocabulary range is recorded on the model (`vocab_parallel.vocab_shard`) so the
log-prob code knows to combine slices instead of calling a dense log-softmax.
Both work on a model built on the meta device (hf.py `load_model_rank0`); `materialize` then gives it storage
and rank 0's checkpoint values, so only rank 0 ever holds the full model.
LoRA adapters (lora.py) are split with the module they adapt, so that `B @ A` is sharded like its base weight.
Model code never imports this. Left out on purpose: sequence parallelism, pipeline parallelism, and
tp-aware rollout engines (the native engine holds a full copy of the weights).
"""
from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from sparserl.actor.logprobs import SHARD_ATTR, install_logprob_head
from sparserl.actor.lora import tp_targets
from sparserl.actor.tp_plans import tp_plan
from sparserl.actor.vocab_parallel import ATTR, VocabShard
from sparserl.parallel import ParallelDims, fsdp_mesh


EXTRA_PLAN = "sparserl_extra_tp_plan"  # a model attribute: plan entries for modules added to it (actor/critic.py)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected model.model.layers (a Hugging Face decoder)")
    return list(layers)


def parallelize(model: torch.nn.Module, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
    install_logprob_head(model)  # before tp: the head's own forward works on local vocabulary slices
    tp = mesh["tp"]
    if tp.size() > 1:
        trains = {name: p.requires_grad for name, p in model.named_parameters()}
        apply_tensor_parallel(model, tp)
        for name, p in model.named_parameters():  # the parallel styles make new Parameters; frozen stays frozen
            p.requires_grad_(trains[name])
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    dp = fsdp_mesh(mesh)  # dp, or dp x cp flattened: the cp ranks hold the same parameters
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, full_state: dict[str, torch.Tensor],
                buffers: dict[str, torch.Tensor]) -> None:
    """Give a model parallelized on the meta device storage on `device` and the checkpoint's values.

    `full_state` is the full state dict on global rank 0 and empty elsewhere: rank 0 broadcasts it one tensor at
    a time and every rank copies out its own (dp, tp) shard (`set_model_state_dict`), so no other rank ever
    holds more than one full tensor. `buffers` (non-persistent, so in no state dict) are copied on every rank.
    A collective over the default process group.
    """
    model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, value in buffers.items():
        buf = model.get_buffer(name)
        (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(value)


# ---------------------------------------------------------------------------------------------- tensor parallel
class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors on the tp mesh; the module computes on DTensors made from its local
    inputs (declared with `input_layout`) and returns local tensors.

    With a Replicate input (norms on the replicated activation) every rank computes identical values and
    gradients. With a Shard input (per-head norms on the local heads) the weight gradient comes out Partial and
    FSDP2 sums it over tp when it reduces gradients.
    """

    def __init__(self, input_layout: Placement = Replicate()):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        layout = self.input_layout

        def inputs_to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (layout,), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def output_to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        # partition_fn=None: every parameter of the module is replicated.
        return distribute_module(module, device_mesh, None, inputs_to_dtensor, output_to_local)


class VocabHeadParallel(ColwiseParallel):
    """LM-head rows split by vocabulary id, with no input/output hooks: the head's forward (installed by
    `logprobs.install_logprob_head`) takes the replicated hidden states as a local tensor and produces this rank's
    (N, V/tp) logits, or their chunked log-probs, from the local weight rows."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn)


def _styles() -> dict[str, ParallelStyle]:
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "vocab_head": VocabHeadParallel(),  # logits stay (N, V/tp)
        "replicate": ReplicateParallel(),
        "head_norm": ReplicateParallel(Shard(2)),  # input (B, T, H_local, D): split over heads
    }


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """Split `model` over the 1-D `tp_mesh` in place, following its family's plan."""
    ParallelDims(dp=1, tp=tp_mesh.size()).validate_model(model.config)
    plan = {**tp_plan(model.config), **getattr(model, EXTRA_PLAN, {})}  # modules a prepare step added (a value head)
    styles = _styles()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    matched = {key: 0 for key in plan}
    for name, module in list(model.named_modules()):
        key = next((k for k in plan if fnmatch(name, k)), None)
        if key is not None:
            # src_data_rank=None: no scatter. Either every rank loaded the same checkpoint and keeps its own slice,
            # or the model is on the meta device and its values arrive later from rank 0 (`materialize`).
            # A LoRA-adapted module is split part by part (lora.py `tp_targets`).
            for _, part, style in tp_targets(name, module, plan[key]):
                parallelize_module(part, tp_mesh, styles[style], src_data_rank=None)
            matched[key] += 1
    missing = [k for k, n in matched.items() if n == 0]
    if missing:
        raise ValueError(f"tensor-parallel plan for model_type={model.config.model_type!r}: no module matches {missing}")
    if tied:  # both sides were split by vocabulary rows into equal slices: share one parameter again
        head.weight = embed.weight
    loose = [n for n, p in model.named_parameters() if not (isinstance(p, DTensor) and p.device_mesh == tp_mesh)]
    if loose:
        raise ValueError(f"tensor-parallel plan for model_type={model.config.model_type!r} leaves parameters unsplit: "
                         f"{loose[:4]}{'...' if len(loose) > 4 else ''}")
    shard = _vocab_shard(head.weight, tp_mesh)
    setattr(model, ATTR, shard)
    setattr(head, SHARD_ATTR, shard)


def _vocab_shard(weight: DTensor, tp_mesh) -> VocabShard:
    V = weight.shape[0]
    size = weight.to_local().shape[0]
    chunk = -(-V // tp_mesh.size())  # DTensor Shard(0) splits like torch.chunk
    start = min(tp_mesh.get_local_rank() * chunk, V)
    assert size == min(chunk, V - start), (size, chunk, V, start)
    return VocabShard(start=start, size=size, group=tp_mesh.get_group())
