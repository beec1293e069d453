"""Seeded draws for the SGLang sampler: the token a sequence samples depends only on (its seed, its position).

SGLang batches requests however its scheduler likes (and may retract and recompute a sequence), so one
generator per process would make a sample depend on what else shared its batch. Here each row's noise is a
function of (the sequence's seed, the logical position being sampled): the same sequence draws the same
tokens whatever its batch, its retractions or the engine's restarts. The position must be the *logical* one
(tokens before it in the sequence), not the KV cache's physical length: with KV compression the physical
length falls back after every compaction, and noise keyed by it would come back every few tokens, drawing
each token correlated with an earlier one of the same sequence (`kv_backend.py` hands the sampler the
logical positions). The draw is the exponential race over `processed_logprobs` (argmax of logp - log E,
E ~ Exp(1)), which samples exactly from the processed distribution, and the reported log-prob is read from
that same distribution: the contract of `engines/types.py::SamplingParams`, computed by the same function
the actor uses.

No device-to-host synchronization: the per-row settings come from the host (`RowSettings.from_rows`, built
from the requests' parameters), and the noise is counter-based, one hash of (row key, vocabulary index) for
the whole (B, V) block in a few integer kernels, instead of one seeded generator per row and a
`keys.tolist()` per step. Two rows share a noise value only where their 32-bit stream offsets collide, about
once in 2**32 / V pairs, and then at different token indices.

Pure tensor code, no sglang import, so it is tested in the main environment. Left out on purpose: min-p,
penalties and logit bias (not part of RL rollouts here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparserl.model.sampling import processed_logprobs

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # odd: v -> v * _GOLDEN mod 2**32 is a bijection, spreading the vocabulary index


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


def _signed32(x: torch.Tensor) -> torch.Tensor:
    # int64 values in [0, 2**32) -> the int32 with the same bits (exact: no conversion overflows).
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _mix_block(h: torch.Tensor) -> torch.Tensor:
    # A 32-bit xorshift-multiply finalizer for the (B, V) block, in int32: half the memory traffic of int64
    # and a native vector multiply. Products wrap mod 2**32 (two's complement); right shifts are masked so
    # they act as logical shifts on the sign bit. tests/sglang/test_draw.py checks it against int64 math.
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * 0x1B873593
    return h ^ ((h >> 16) & 0xFFFF)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (B,) int64 in [0, 2**62)
    """One noise key per (seed, position); seeds are any int64, positions non-negative. 62 bits, so two
    rows of a run practically never share a key."""
    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    pos = _mul32(positions.to(torch.int64) & _M32, 0x9E3779B1)
    a = _fmix32(lo ^ _fmix32(hi ^ pos ^ 0x68E31DA4))
    b = _fmix32(hi ^ _fmix32(lo ^ pos ^ 0x1B873593))
    return ((a & 0x3FFFFFFF) << 32) | b


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V) float32 in (0, 1)
    """Uniform noise per row, a function of the row's key and the vocabulary index only (a row's noise does
    not depend on the other rows). 23-bit values at bin centres, exact in float32: never 0 or 1."""
    keys = keys.to(torch.int64)
    offset = _fmix32((keys & _M32) ^ _fmix32(((keys >> 32) & _M32) ^ 0x5BD1E995))  # (B,) 32-bit stream offset
    index = _mul32(torch.arange(vocab, device=keys.device, dtype=torch.int64), _GOLDEN)  # (V,)
    bits = _mix_block(_signed32(index)[None, :] + _signed32(offset)[:, None])  # (B, V) int32, the sum wraps
    return (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings on the device, and the two facts the draw needs, known on the host."""

    temperature: torch.Tensor  # (B,) float32, 0 = greedy
    top_p: torch.Tensor  # (B,) float32
    top_k: torch.Tensor  # (B,) int64, 0 = off
    seeds: torch.Tensor  # (B,) int64
    all_greedy: bool
    truncate: bool  # some row uses top-k or top-p

    @classmethod
    def from_rows(cls, rows: list, device) -> "RowSettings":
        """rows: one (seed, temperature, top_p, top_k) per row, Python numbers."""
        seed, temp, top_p, top_k = zip(*rows) if rows else ((), (), (), ())
        return cls(torch.tensor(temp, dtype=torch.float32, device=device),
                   torch.tensor(top_p, dtype=torch.float32, device=device),
                   torch.tensor(top_k, dtype=torch.long, device=device),
                   torch.tensor(seed, dtype=torch.int64, device=device),
                   all(t == 0 for t in temp), any(p < 1.0 or k > 0 for p, k in zip(top_p, top_k)))


def sample(
    logits: torch.Tensor,  # (B, V) raw logits
    settings: RowSettings,
    positions: torch.Tensor,  # (B,) logical position of the token that produced the logits
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens (B,) int64, processed log-probs (B, V) float32
    """Draw one token per row from the processed distribution; return it with that distribution's log-probs."""
    s = settings
    logp = processed_logprobs(logits, s.temperature, s.top_p, s.top_k, truncate=s.truncate)  # -inf outside kept set
    if s.all_greedy:
        return logp.argmax(dim=-1), logp
    u = uniform(row_keys(s.seeds, positions), logp.shape[-1])
    race = logp - torch.log(-torch.log1p(-u))  # argmax of p / E, E = -log(1 - u) ~ Exp(1)
    tokens = torch.where(s.temperature == 0, logp.argmax(dim=-1), race.argmax(dim=-1))
    return tokens, logp
