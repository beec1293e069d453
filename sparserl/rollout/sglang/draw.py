"""Seeded draws for the SGLang sampler: the token a sequence samples depends only on (its seed, its position).

SGLang batches requests however its scheduler likes (and may retract and recompute a sequence), so one
generator per process would make a sample depend on what else shared its batch. Here each row's noise comes
from a generator seeded with a hash of (the sequence's seed, the position being sampled): the same sequence
draws the same tokens whatever its batch, its retractions or the engine's restarts. The draw is the
exponential race over `processed_logprobs` (argmax of logp - log E, E ~ Exp(1)), which samples exactly from
the processed distribution, and the reported log-prob is read from that same distribution: the contract of
`rollout/types.py::SamplingParams`, computed by the same function the actor uses.

Pure tensor code, no sglang import, so it is tested in the main environment. Left out on purpose: min-p,
penalties and logit bias (not part of RL rollouts here), and a fused kernel for the per-row noise (one
`torch.rand` per row and step; on a GPU that is one small launch per running sequence).
"""
from __future__ import annotations

import torch

from sparserl.rollout.sampling import processed_logprobs

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32) without overflowing int64: split x into 16-bit halves.
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's finalizer: every input bit affects every output bit.
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (B,) int64 in [0, 2**62)
    """One generator seed per (seed, position); seeds are any int64, positions non-negative. 62 bits, so two
    rows of a run practically never share a noise stream."""
    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    pos = _mul32(positions.to(torch.int64) & _M32, 0x9E3779B1)
    a = _fmix32(lo ^ _fmix32(hi ^ pos ^ 0x68E31DA4))
    b = _fmix32(hi ^ _fmix32(lo ^ pos ^ 0x1B873593))
    return ((a & 0x3FFFFFFF) << 32) | b


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V) float32 in [0, 1)
    """Uniform noise per row from a generator seeded with the row's key (one stream per row, so a row's
    noise does not depend on the other rows)."""
    out = torch.empty(keys.shape[0], vocab, device=keys.device, dtype=torch.float32)
    gen = torch.Generator(device=keys.device)
    for r, key in enumerate(keys.tolist()):
        gen.manual_seed(key)
        torch.rand(vocab, generator=gen, device=keys.device, out=out[r])
    return out


def sample(
    logits: torch.Tensor,  # (B, V) raw logits
    temperature: torch.Tensor,  # (B,) 0 = greedy
    top_p: torch.Tensor,  # (B,)
    top_k: torch.Tensor,  # (B,) 0 = off
    seeds: torch.Tensor,  # (B,) int64
    positions: torch.Tensor,  # (B,) position of the token that produced the logits
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens (B,) int64, processed log-probs (B, V) float32
    """Draw one token per row from the processed distribution; return it with that distribution's log-probs."""
    logp = processed_logprobs(logits, temperature, top_p, top_k)  # (B, V), -inf outside the kept set
    greedy = temperature == 0
    if bool(greedy.all()):
        return logp.argmax(dim=-1), logp
    u = uniform(row_keys(seeds, positions), logp.shape[-1])
    exp_noise = (-torch.log1p(-u)).clamp_min(1e-20)  # E = -log(1 - u) ~ Exp(1)
    race = logp - torch.log(exp_noise)  # argmax of p / E
    tokens = torch.where(greedy, logp.argmax(dim=-1), race.argmax(dim=-1))
    return tokens, logp
