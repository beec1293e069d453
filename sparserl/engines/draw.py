"""Seeded draws shared by both engines: the token a sequence samples depends only on (its seed, its logical
position, the logits).

Engines batch requests however their schedulers like (SGLang may also retract and recompute a sequence), so
one generator per process would make a sample depend on what else shared its batch, and one generator per
row costs a Python loop and a vocabulary-sized random draw per row every step. Here each row gets one uniform
number, a hash of (the sequence's seed, the position of the token that produced the logits), and the token is
its inverse CDF under `processed_logprobs`: the first token whose cumulative probability (float64) exceeds
u x total. That samples exactly from the processed distribution (tokens outside the kept set have zero width
and are never drawn), and the reported log-prob is read from that same distribution: the contract of
`engines/types.py::SamplingParams`, computed by the same function the actor uses.

The position must be the *logical* one (tokens before it in the sequence), not the KV cache's physical length:
with KV compression the physical length falls back after every compaction, and a key made from it would come
back every few tokens, drawing each token correlated with an earlier one of the same sequence (the native
engine counts logical positions itself; SGLang's `kv_backend.py` hands the sampler the logical positions).
Both engines derive the seed the same way (`utils.seed.sample_seed`), so on the same logits they draw the same
tokens.

No device-to-host synchronization: the per-row settings come from the host (`RowSettings.from_rows`, built
from the requests' parameters, or `RowSettings.from_tensors`: device buffers plus flags from those parameters),
and the keys are a few integer kernels over (B,) tensors. A step costs one pass over the probabilities (exp,
cumulative sum, search), much less than a seeded vocabulary-sized draw per row and the
exponential race over them (docs/performance.md has the decode step's breakdown).

Pure tensor code, no sglang import. Left out on purpose: min-p, penalties and logit bias (not part of RL
rollouts here).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from sparserl.model.sampling import processed_logprobs

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
    """One key per (seed, position); seeds are any int64, positions non-negative. 62 bits, so two rows of a run
    practically never share a key."""
    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    pos = _mul32(positions.to(torch.int64) & _M32, 0x9E3779B1)
    a = _fmix32(lo ^ _fmix32(hi ^ pos ^ 0x68E31DA4))
    b = _fmix32(hi ^ _fmix32(lo ^ pos ^ 0x1B873593))
    return ((a & 0x3FFFFFFF) << 32) | b


def row_uniform(keys: torch.Tensor) -> torch.Tensor:  # (B,) float64 in (0, 1)
    """One uniform number per key: 53 hashed bits at bin centres, exact in float64, never 0 or 1."""
    keys = keys.to(torch.int64)
    lo, hi = keys & _M32, (keys >> 32) & _M32
    a = _fmix32(lo ^ _fmix32(hi ^ 0x5BD1E995))
    b = _fmix32(hi ^ _fmix32(a ^ 0x27D4EB2F))
    bits = ((a >> 11) << 32) | b  # 21 + 32 = 53 bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2**53)


# On CPU the draw's two (B, V) temporaries (the probabilities, their float64 cumulative sum: 12 + 25 MB at batch 64
# over a 49k vocabulary) are kept for the next step instead of made anew: a fresh tensor of that size is a fresh
# mapping whose every page faults in on first touch, which on an AMD EPYC VM cost more than the draw's arithmetic
# (docs/performance.md). Per thread, and only up to this size (a
# 152k vocabulary at batch 64 is 117 MB; larger batches draw into fresh memory as before). The buffers are made outside
# inference mode whatever the caller's mode: a normal tensor may be written under inference mode, no_grad or neither,
# while one made under inference mode could never be written outside it again (an engine draws under inference mode,
# a sampler plugin or an evaluation helper under no_grad, in the same thread).
_SCRATCH_MAX_BYTES = 128 << 20
_scratch = threading.local()


def _scratch_tensor(name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = shape[0] * shape[1]
    if device.type != "cpu" or numel * dtype.itemsize > _SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:numel].view(shape)


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # (B, V), (B,) -> (B,) int64
    """The first index whose cumulative probability exceeds u x (the row's total); -inf entries are never taken."""
    shape = tuple(logp.shape)
    probs = torch.exp(logp, out=_scratch_tensor("probs", shape, logp.dtype, logp.device))
    # The float32 probabilities summed in float64: cast into the float64 buffer, then summed in place. (cumsum with
    # dtype=float64 casts into a temporary of its own, a fresh 25 MB mapping per step at batch 64.)
    cdf = _scratch_tensor("cdf", shape, torch.float64, logp.device).copy_(probs).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # u x total may round up to the total itself: the largest double below it keeps the draw on a token with mass.
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings on the device, and the two facts the draw needs, known on the host."""

    temperature: torch.Tensor  # (B,) float32, 0 = greedy
    top_p: torch.Tensor  # (B,) float32
    top_k: torch.Tensor  # (B,) int64, 0 = off
    seeds: torch.Tensor  # (B,) int64
    all_greedy: bool
    truncate: bool  # some row uses top-k or top-p
    any_greedy: bool = True
    shared_temperature: float | None = None  # every row's temperature when they share one (no per-row division)

    @classmethod
    def from_rows(cls, rows: list, device) -> "RowSettings":
        """rows: one (seed, temperature, top_p, top_k) per row, Python numbers."""
        seed, temp, top_p, top_k = zip(*rows) if rows else ((), (), (), ())
        return cls.from_tensors(torch.tensor(temp, dtype=torch.float32, device=device),
                                torch.tensor(top_p, dtype=torch.float32, device=device),
                                torch.tensor(top_k, dtype=torch.long, device=device),
                                torch.tensor(seed, dtype=torch.int64, device=device), temp, top_p, top_k)

    @classmethod
    def from_tensors(cls, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, seeds: torch.Tensor,
                     temps: list, top_ps: list, top_ks: list) -> "RowSettings":
        """Settings already on the device (an engine's per-row buffers, gathered for this step), with the host's
        flags computed from the same rows' Python values (`temps`, `top_ps`, `top_ks`): nothing is read back."""
        return cls(temperature, top_p, top_k, seeds, all(t == 0 for t in temps),
                   any(p < 1.0 or k > 0 for p, k in zip(top_ps, top_ks)), any(t == 0 for t in temps),
                   float(temps[0]) if temps and len(set(temps)) == 1 else None)


def sample(
    logits: torch.Tensor,  # (B, V) raw logits
    settings: RowSettings,
    positions: torch.Tensor,  # (B,) logical position of the token that produced the logits
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens (B,) int64, processed log-probs (B, V) float32
    """Draw one token per row from the processed distribution; return it with that distribution's log-probs."""
    s = settings
    temperature = s.temperature if s.shared_temperature is None else s.shared_temperature
    logp = processed_logprobs(logits, temperature, s.top_p, s.top_k, truncate=s.truncate)  # -inf outside kept set
    if s.all_greedy:
        return logp.argmax(dim=-1), logp
    drawn = inverse_cdf(logp, row_uniform(row_keys(s.seeds, positions.to(s.seeds.device))))
    if not s.any_greedy:
        return drawn, logp
    return torch.where(s.temperature == 0, logp.argmax(dim=-1), drawn), logp
