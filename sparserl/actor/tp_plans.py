"""Tensor-parallel plans as data: how each module of a Hugging Face decoder is split over the "tp" mesh axis.

A plan maps module paths (`*` matches a layer index) to a style name; `parallelize.py` turns the names into
DTensor parallel styles. Model code never sees any of this. The styles:

- `colwise`: output features split (q/k/v, gate/up). Each rank computes its own attention heads and MLP
  columns; the attention reads head counts from tensor shapes, so it runs on the local heads unchanged.
- `rowwise`: input features split (o, down); the partial outputs are all-reduced back to a replicated activation.
- `vocab_embedding`: embedding rows split by vocabulary id; each rank looks up the ids it owns and the
  lookups are all-reduced.
- `vocab_head`: lm_head rows split by vocabulary id; every rank keeps its (N, V/tp) slice of the logits and
  `vocab_parallel.py` turns the slices into log-probs without gathering the full vocabulary.
- `replicate`: norms; weights replicated (as DTensors, so that every parameter lives on the same mesh for
  FSDP2, gradient clipping and the optimizer) and computed on the replicated activation.
- `head_norm`: per-head norms that run on the local heads (Qwen3 q_norm / k_norm); their weight gradients
  are partial sums over the local heads and are summed over tp.

Tied embeddings (`tie_word_embeddings`) work because `vocab_embedding` and `vocab_head` split the one shared
(V, H) weight the same way, by rows; `parallelize.py` re-ties the two after splitting.

Left out on purpose: sequence parallelism (norms and residuals stay replicated over tp: simpler, and packed
micro-batches need no padding to a multiple of tp), async TP, and model families beyond those below.
"""
from __future__ import annotations

_DECODER_LAYER = {
    "model.layers.*.input_layernorm": "replicate",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "replicate",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}

_ENDS = {
    "model.embed_tokens": "vocab_embedding",
    "model.norm": "replicate",
    "lm_head": "vocab_head",
}

LLAMA = {**_ENDS, **_DECODER_LAYER}
QWEN2 = {**_ENDS, **_DECODER_LAYER}  # q/k/v biases are split with their weights by `colwise`
QWEN3 = {**QWEN2, "model.layers.*.self_attn.q_norm": "head_norm", "model.layers.*.self_attn.k_norm": "head_norm"}

PLANS: dict[str, dict[str, str]] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


def tp_plan(config) -> dict[str, str]:
    """The plan for a model config, chosen by `config.model_type`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PLANS:
        raise ValueError(f"parallel.tp > 1: no tensor-parallel plan for model_type={model_type!r}; "
                         f"supported: {', '.join(sorted(PLANS))} (add one to sparserl/actor/tp_plans.py)")
    return PLANS[model_type]
