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

from sparserl.rollout.sglang import SAMPLER_ENV_FLAG, draw

BACKEND = "pytorch"  # the SGLang sampling backend whose factory this module replaces
PARAM_KEY = "sparserl"


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
        temperature, top_p, top_k, seeds = _row_settings(sampling_info, logits.shape[0], logits.shape[-1], logits.device)
        tokens, logp = draw.sample(logits, temperature, top_p, top_k, seeds, positions.reshape(-1))
        tokens = tokens.to(torch.int32)
        if return_logprob:
            result = self.output_logprob_processor.compute_logprobs(logp, top_logprobs_nums, token_ids_logprobs, tokens)
            result.write_output_to(logits_output)
        self._sync_token_ids_across_tp(tokens, sampling_info)
        return tokens


def _row_settings(info, rows: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    params = info.custom_params or [None] * rows
    settings = []
    fallback = None
    for i, p in enumerate(params):
        mine = p.get(PARAM_KEY) if isinstance(p, dict) else None
        if mine is None:
            if fallback is None:  # one device-to-host copy, only when a foreign request is present
                fallback = (info.temperatures.reshape(-1).tolist(), info.top_ps.reshape(-1).tolist(),
                            info.top_ks.reshape(-1).tolist())
            k = int(fallback[2][i])
            mine = [random.getrandbits(62), fallback[0][i], fallback[1][i], k if 0 < k < vocab else 0]
        settings.append(mine)
    seed, temp, top_p, top_k = zip(*settings)
    return (torch.tensor(temp, dtype=torch.float32, device=device), torch.tensor(top_p, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.long, device=device), torch.tensor(seed, dtype=torch.int64, device=device))


def register() -> None:
    """The `sglang.srt.plugins` entry point: in engines started by sparserl, SGLang's "pytorch" sampling
    backend becomes `SparserlSampler`; elsewhere nothing changes."""
    if os.environ.get(SAMPLER_ENV_FLAG) != "1":
        return
    from sglang.srt.layers import sampler as sglang_sampler

    if sglang_sampler._CUSTOM_SAMPLER_FACTORIES.get(BACKEND) is not SparserlSampler:  # plugins may load twice
        register_sampler_backend(BACKEND, SparserlSampler)
