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

Per-request settings travel in `sampling_params.custom_params["sparserl"] = [seed, temperature, top_p, top_k]`
(SGLang keeps `custom_params` on each request whether or not a custom logit processor is set; none is). They
reach the device where SGLang's own per-request tensors do, and as often: `BatchRows` rides on SGLang's
`SamplingBatchInfo` as `sparserl_rows`, built when SGLang builds the batch's sampling info (one pinned,
non-blocking copy per batch, not per step), indexed on the device when SGLang filters the batch, concatenated
when it merges two, and carried over to the forward-only copy the overlap scheduler makes (four hooks through
SGLang's `HookRegistry`). A sampling step then reads those tensors and the host-known flags as they are: no
host-to-device copy, no device read, no `nonzero` (the custom-logit-processor path SGLang would otherwise run
to hand the sampler `custom_params` per step is not used). Rows without sparserl's settings (a request not
sent by sparserl) use their SGLang temperature / top-p / top-k and a fresh random seed, chosen on the host when
the batch is built.

This module imports sglang; SGLang loads it in each of its processes (the scheduler runs in a spawned
subprocess) through the `sglang.srt.plugins` entry point in setup.py, which calls `register()`.
Left out on purpose: sampling masks, grammars and speculative decoding, which fall back to SGLang's sampler.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

import torch
from sglang.srt.layers.sampler import Sampler, register_sampler_backend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sparserl.engines import draw
from sparserl.engines.sglang import SAMPLER_ENV_FLAG

BACKEND = "pytorch"  # the SGLang sampling backend whose factory this module replaces
PARAM_KEY = "sparserl"
ROWS = "sparserl_rows"  # a BatchRows on SGLang's SamplingBatchInfo, kept by the hooks below
LOGICAL_POSITIONS = "sparserl_logical_positions"  # set on SGLang's SamplingBatchInfo by kv_backend.py per forward
DRAWN_POSITIONS = "sparserl_drawn"  # the positions the last draw was keyed by (read by kv_backend.py's trace)
_CARRIED = (ROWS, LOGICAL_POSITIONS)  # what the forward-only copy of a SamplingBatchInfo keeps
_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRows:
    """One batch's sampling settings: per row (seed, temperature, top_p, top_k) on the host, for the flags the
    draw needs known on the host, and the same on the device as `draw.RowSettings`."""

    rows: tuple
    settings: draw.RowSettings

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def build(cls, rows: list, device) -> "BatchRows":
        """Two host-to-device copies (floats, integers), from pinned memory and non-blocking where on CUDA."""
        device = torch.device(device)
        seed, temp, top_p, top_k = zip(*rows) if rows else ((), (), (), ())
        floats = _to_device([list(temp), list(top_p)], torch.float32, device)
        ints = _to_device([list(top_k), list(seed)], torch.int64, device)
        return cls._of(tuple(rows), floats[0], floats[1], ints[0], ints[1])

    @classmethod
    def _of(cls, rows: tuple, temperature, top_p, top_k, seeds) -> "BatchRows":
        # The host facts exactly as `draw.RowSettings.from_rows` derives them, so the draw is the same.
        temp = [r[1] for r in rows]
        truncate = any(r[2] < 1.0 or r[3] > 0 for r in rows)
        shared = float(temp[0]) if temp and len(set(temp)) == 1 else None
        settings = draw.RowSettings(temperature, top_p, top_k, seeds, all(t == 0 for t in temp), truncate,
                                    any(t == 0 for t in temp), shared)
        return cls(rows, settings)

    def filter(self, keep: list[int], keep_device: torch.Tensor) -> "BatchRows":
        """The rows SGLang keeps, indexed on the device by its own index tensor."""
        s = self.settings
        keep_device = keep_device.to(s.seeds.device)
        return self._of(tuple(self.rows[i] for i in keep), s.temperature[keep_device], s.top_p[keep_device],
                        s.top_k[keep_device], s.seeds[keep_device])

    def merge(self, other: "BatchRows") -> "BatchRows":
        a, b = self.settings, other.settings
        return self._of(self.rows + other.rows, torch.cat([a.temperature, b.temperature]),
                        torch.cat([a.top_p, b.top_p]), torch.cat([a.top_k, b.top_k]), torch.cat([a.seeds, b.seeds]))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def request_row(params, vocab: int) -> list:
    """(seed, temperature, top_p, top_k) of one request from its SGLang `SamplingParams`: sparserl's settings,
    else SGLang's own (normalized: greedy is top_k 1, no top-k is a k past the vocabulary) and a random seed."""
    custom = params.custom_params
    mine = custom.get(PARAM_KEY) if isinstance(custom, dict) else None
    if mine is not None:
        return list(mine)
    k = int(params.top_k)
    return [random.getrandbits(62), float(params.temperature), float(params.top_p), k if 0 < k < vocab else 0]


class SparserlSampler(Sampler):
    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs, positions,
                *, logprob_logits=None):
        if sampling_info.sampling_mask_batch_indices is not None or sampling_info.grammars or logprob_logits is not None:
            return super().forward(logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs,
                                   positions, logprob_logits=logprob_logits)
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)  # (B, V)
        settings = row_settings(sampling_info, logits.shape[0], logits.shape[-1])
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


def row_settings(info, rows: int, vocab: int) -> draw.RowSettings:
    """This step's settings: the batch's `BatchRows` as the hooks keep them (no copy, no sync). A batch the hooks
    did not see (none in SGLang 0.5.23's paths that reach this sampler) reads SGLang's tensors instead: one
    device-to-host copy, and a warning."""
    kept = getattr(info, ROWS, None)
    if kept is not None and len(kept) == rows:
        return kept.settings
    logger.warning("sparserl sampler: a batch of %d rows without its settings (%s); reading SGLang's instead, "
                   "with fresh seeds", rows, "none" if kept is None else f"{len(kept)} rows")
    temps, top_ps, top_ks = (info.temperatures.reshape(-1).tolist(), info.top_ps.reshape(-1).tolist(),
                             info.top_ks.reshape(-1).tolist())
    fallback = [[random.getrandbits(62), t, p, int(k) if 0 < k < vocab else 0] for t, p, k in zip(temps, top_ps, top_ks)]
    return BatchRows.build(fallback, info.temperatures.device).settings


# ------------------------------------------------------------------ SamplingBatchInfo hooks (host side, per batch change)
def _after_from_schedule_batch(result, info, batch, vocab_size, *args, **kwargs):
    setattr(info, ROWS, BatchRows.build([request_row(r.sampling_params, vocab_size) for r in batch.reqs], info.device))


def _after_filter_batch(result, info, keep_indices, keep_indices_device, *args, **kwargs):
    kept = getattr(info, ROWS, None)
    if kept is not None:
        setattr(info, ROWS, kept.filter(list(keep_indices), keep_indices_device))


def _after_merge_batch(result, info, other, *args, **kwargs):
    mine, theirs = getattr(info, ROWS, None), getattr(other, ROWS, None)
    setattr(info, ROWS, mine.merge(theirs) if mine is not None and theirs is not None else None)


def _after_copy_for_forward(result, info, *args, **kwargs):
    for name in _CARRIED:
        setattr(result, name, getattr(info, name, None))
    return result


def register() -> None:
    """The `sglang.srt.plugins` entry point: in engines started by sparserl, SGLang's "pytorch" sampling
    backend becomes `SparserlSampler` and the batch's settings follow SGLang's batch; elsewhere nothing changes."""
    if os.environ.get(SAMPLER_ENV_FLAG) != "1":
        return
    from sglang.srt.layers import sampler as sglang_sampler

    if sglang_sampler._CUSTOM_SAMPLER_FACTORIES.get(BACKEND) is SparserlSampler:  # plugins may load twice
        return
    register_sampler_backend(BACKEND, SparserlSampler)
    HookRegistry.register(f"{_INFO}.adjusted_from_schedule_batch", _after_from_schedule_batch, HookType.AFTER)
    HookRegistry.register(f"{_INFO}.adjusted_filter_batch", _after_filter_batch, HookType.AFTER)
    HookRegistry.register(f"{_INFO}.adjusted_merge_batch", _after_merge_batch, HookType.AFTER)
    HookRegistry.register(f"{_INFO}.copy_for_forward", _after_copy_for_forward, HookType.AFTER)
