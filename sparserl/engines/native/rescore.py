"""Measure-only split of the sampler mismatch into its KV-compression and its weight share.

With compressed *and* quantized rollouts, `mismatch/kl` (the trainer's mean of logp_sparse - logp_old) has
two sources. Per token it splits exactly:

    logp_sparse - logp_old = (logp_sparse - logp_engine_dense)  +  (logp_engine_dense - logp_old)
                             KV compression (same weights)         the engine's weights: quantization, dtype

`logp_engine_dense` is what the engine's own weights give the same tokens with a full KV cache. With
`rollout.rescore_seqs=k` the engine re-scores k evenly spaced sequences of each `generate` call in one
dense forward each and reports `rollout/kv_mismatch_kl` (the first term, averaged over their response
tokens); `mismatch/kl - rollout/kv_mismatch_kl` estimates the second. Nothing here changes a sample or the
loss. Left out on purpose: models that transform logits after the LM head (soft-capping, logit scaling).
"""
from __future__ import annotations

import torch

from sparserl.model.attention import ForwardContext, Span, forward_context
from sparserl.engines.native.sequence import Sequence
from sparserl.model.sampling import processed_logprobs

CHUNK_ROWS = 256  # LM-head rows at a time: bounds the (rows, V) float32 logits of a long response


def pick(seqs: list[Sequence], k: int) -> list[Sequence]:
    """k sequences spread evenly over the batch (all of them when k >= len)."""
    if k <= 0 or not seqs:
        return []
    if k >= len(seqs):
        return list(seqs)
    return [seqs[(i * len(seqs)) // k] for i in range(k)]


@torch.inference_mode()
def dense_logprobs(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    """(len(output),) float32 log-probs of the sequence's sampled tokens under its own sampling transform,
    computed by `model` over the full (uncompressed) context."""
    device = next(model.parameters()).device
    ids = seq.prompt + seq.output[:-1]  # the last sampled token is never fed back
    p = len(seq.prompt)
    with forward_context(ForwardContext(spans=[Span(0, len(ids))])):
        hidden = model.get_decoder()(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(len(ids), device=device)[None],
            use_cache=False,
        ).last_hidden_state[0, p - 1 :]  # (len(output), H): row t predicts output token t
    head = model.get_output_embeddings()
    targets = torch.tensor(seq.output, device=device)
    sp = seq.params
    out = []
    for s in range(0, hidden.shape[0], CHUNK_ROWS):
        logp = processed_logprobs(head(hidden[s : s + CHUNK_ROWS]), sp.temperature, sp.top_p, sp.top_k)
        out.append(logp.gather(-1, targets[s : s + CHUNK_ROWS, None])[:, 0])
    return torch.cat(out)


def kv_share(model: torch.nn.Module, seqs: list[Sequence]) -> tuple[float, int]:
    """(sum over response tokens of logp_sparse - logp_engine_dense, token count) for `seqs`."""
    total, tokens = 0.0, 0
    for seq in seqs:
        if not seq.output:
            continue
        dense = dense_logprobs(model, seq)
        total += float((torch.tensor(seq.logps, dtype=torch.float32) - dense.float().cpu()).sum())
        tokens += len(seq.output)
    return total, tokens
