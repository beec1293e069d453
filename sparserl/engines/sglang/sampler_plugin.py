"""SGLang's sampler, replaced by one that draws and scores with sparserl's sampling transform.

Why a replacement: SGLang 0.5.23's sampler reports log(softmax(logits / T)) for the sampled token, that is
temperature applied but, under top-p / top-k, *not* renormalized over the kept set (its `return_sampling_mask`
option renormalizes, but only for a finite top_k below `--sampling-mask-max-tokens`, and aborts requests
otherwise); and it draws with one generator per scheduler process, so a sample depends on whatever shared its
batch (per-request seeds need `--enable-deterministic-inference`, which pins attention backends and swaps
matmuls for batch-invariant kernels). `SparserlSampler` computes `processed_logprobs` (the function the actor
recomputes with), draws with `draw.sample`, and hands SGLang those log-probs, so `output_token_logprobs` are
the processed distribution's.

It is registered as the factory of SGLang's "pytorch" sampling backend, and only in processes started with
`SPARSERL_SGLANG_SAMPLER=1` (the SGLang engine sets it before starting SGLang, so its subprocesses inherit it):
SGLang's CPU path forces `sampling_backend="pytorch"` whatever it is given, and custom factories are looked up
before the built-in samplers. Any other SGLang use of the same environment keeps SGLang's own sampler.

Per-request settings travel in `custom_params["sparserl"] = [seed, temperature, top_p, top_k]`. SGLang passes
`custom_params` to the sampler only for requests that carry a custom logit processor; `SamplingTicket` is that
processor and leaves the logits unchanged. Rows without the settings (a request not sent by sparserl) are
sampled with SGLang's own temperature / top-p / top-k and a fresh random seed.

This module imports sglang; SGLang loads it in each of its processes (the scheduler runs in a spawned
subprocess) through the `sglang.srt.plugins` entry point in setup.py, which calls `register()`.
Left out on purpose: sampling masks, grammars and speculative decoding, which fall back to SGLang's sampler.
"""
from __future__ import annotations

import os
import random

import torch
from sglang.srt.layers.sampler import Sampler, register_sampler_backend
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from sparserl.engines import draw
from sparserl.engines.sglang import SAMPLER_ENV_FLAG

BACKEND = "pytorch"  # the SGLang sampling backend whose factory this module replaces
PARAM_KEY = "sparserl"
LOGICAL_POSITIONS = "sparserl_logical_positions"  # set on SGLang's SamplingBatchInfo by kv_backend.py per forward
DRAWN_POSITIONS = "sparserl_drawn"  # the positions the last draw was keyed by (read by kv_backend.py's trace)


class SamplingTicket(CustomLogitProcessor):
    """Identity logit processor; its presence makes SGLang hand `custom_params` to the sampler."""

    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        return logits


class SparserlSampler(Sampler):
    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs, positions,
                *, logprob_logits=None):
        if sampling_info.sampling_mask_batch_indices is not None or sampling_info.grammars or logprob_logits is not None:
            return super().forward(logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs,
                                   positions, logprob_logits=logprob_logits)
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)  # (B, V)
        settings = _row_settings(sampling_info, logits.shape[0], logits.shape[-1], logits.device)
        positions = draw_positions(sampling_info, positions.reshape(-1))
        tokens, logp = draw.sample(logits, settings, positions)
        tokens = tokens.to(torch.int32)
        if return_logprob:
            result = self.output_logprob_processor.compute_logprobs(logp, top_logprobs_nums, token_ids_logprobs, tokens)
            result.write_output_to(logits_output)
        self._sync_token_ids_across_tp(tokens, sampling_info)
        return tokens


def draw_positions(sampling_info, positions: torch.Tensor) -> torch.Tensor:
    """The positions that key this step's noise: the logical ones the `sparserl_kv` backend computed for this
    forward (SGLang hands the sampler the forward batch's own positions, which under KV compaction are the
    physical lengths), else SGLang's. Kept on `sampling_info` as `sparserl_drawn` for the backend's trace."""
    logical = getattr(sampling_info, LOGICAL_POSITIONS, None)
    if logical is not None and logical.shape == positions.shape:
        positions = logical
    setattr(sampling_info, DRAWN_POSITIONS, positions)
    return positions


def _row_settings(info, rows: int, vocab: int, device) -> draw.RowSettings:
    """Settings from the requests' `custom_params` (host lists: no device sync); a foreign request's from
    SGLang's tensors (one device-to-host copy, only when such a request is in the batch)."""
    params = info.custom_params or [None] * rows
    settings = []
    fallback = None
    for i, p in enumerate(params):
        mine = p.get(PARAM_KEY) if isinstance(p, dict) else None
        if mine is None:
            if fallback is None:
                fallback = (info.temperatures.reshape(-1).tolist(), info.top_ps.reshape(-1).tolist(),
                            info.top_ks.reshape(-1).tolist())
            k = int(fallback[2][i])
            mine = [random.getrandbits(62), fallback[0][i], fallback[1][i], k if 0 < k < vocab else 0]
        settings.append(mine)
    return draw.RowSettings.from_rows(settings, device)


def register() -> None:
    """The `sglang.srt.plugins` entry point: in engines started by sparserl, SGLang's "pytorch" sampling
    backend becomes `SparserlSampler`; elsewhere nothing changes."""
    if os.environ.get(SAMPLER_ENV_FLAG) != "1":
        return
    from sglang.srt.layers import sampler as sglang_sampler

    if sglang_sampler._CUSTOM_SAMPLER_FACTORIES.get(BACKEND) is not SparserlSampler:  # plugins may load twice
        register_sampler_backend(BACKEND, SparserlSampler)
