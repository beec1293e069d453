"""Types that every rollout engine agrees on.

Engines take `GenerationRequest`s and return `Generation`s; nothing else crosses the engine boundary.
Left out on purpose: tokenization (the worker owns it) and multi-turn state (the env loop owns it). An
engine may keep a trajectory's KV cache between turns (`GenerationRequest.session_id`), but the tokens of
the trajectory stay the caller's: every turn still sends the whole history as its prompt.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    `logp_sparse` returned for a sampled token is its log-probability under the *processed* distribution
    that drew it: logits / temperature, restricted to the top-k and top-p kept set, renormalized. For greedy
    decoding (a point mass) the engine reports the temperature-1 log-probability instead, which is what a
    dense recompute at temperature 1 would compare against.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Normalise list inputs (from configs or users) to tuples so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stops = self.stop_strings
        if isinstance(stops, str):
            stops = (stops,)
        object.__setattr__(self, "stop_strings", tuple(stops))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive int, got {self.n!r}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise TypeError(f"SamplingParams.stop_strings must hold non-empty str, got {s!r} ({type(s).__name__})")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise TypeError(f"SamplingParams.stop_token_ids must hold non-negative ints, got {t!r}")

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Resume:
    """A sample generated in part by an earlier `generate` call (a partial rollout carried across steps): the request
    continues it instead of starting a new one. `token_ids`, `logp_sparse` and `compressed_at` are what the earlier
    call returned for it (`Generation`); the engine prefills prompt + `token_ids` at their logical positions (a
    compressed cache compacted again where it was, `compressed_at`) and draws on from there with the sample's own
    stream, so `sample_index` must be the one it had. Its `Generation` starts with these tokens and log-probs, as
    given: each token keeps the log-prob of the weights and cache that drew it."""

    sample_index: int
    token_ids: list[int]
    logp_sparse: list[float]
    compressed_at: list[int] = field(default_factory=list)
    # The compression budget it was drawn under (`KVStats.kv_budget`): it keeps that budget until it ends, whatever the
    # engine's is now (`rollout.kv.budget=auto`), so its replayed compactions are the ones it was drawn with. None:
    # the engine's current budget, on the dense worst-case reservation.
    kv_budget: int | None = None


@dataclass(frozen=True)
class Cutoff:
    """When a `generate` call may stop before every sample has ended (partial rollouts): once `finish_frac` of its
    sequences have ended, and, per sequence, after `max_tokens` new tokens in this call (0: no bound). The
    sequences it stops come back with finish_reason "abort" and what they drew so far; those of the requests in
    `exempt` (indices into the call's list) run to their own end, and while one still runs the share does not stop
    the others (the call lasts until it ends anyway)."""

    finish_frac: float = 1.0
    max_tokens: int = 0
    exempt: frozenset[int] = frozenset()


@dataclass
class GenerationRequest:
    """One prompt to complete `params.n` times. `request_id` is echoed back in every `Generation`.

    A sample's random stream is keyed by (`params.seed` or the engine's seed, `seed_index`, sample index);
    `seed_index=None` stands for the request's position in the list given to `generate`. Setting it (eval:
    the prompt's row in its dataset) makes the draws independent of how prompts are split into batches.

    Sessions (multi-turn; honoured where the engine's `supports_sessions` is True, ignored elsewhere):
    `keep_session=True` asks the engine to hold each sample's KV cache after it finishes, under the key it
    returns as `Generation.session_id` (`session_id` itself for n=1, `(session_id, sample_index)` for n>1).
    A later request with that key as its `session_id` (n=1) continues the held cache: its prompt must be the
    held tokens followed by new ones (the previous prompt, response and the observation), and only the new
    tokens are prefilled. A key the engine does not hold (never kept, or dropped under pool pressure) is
    prefilled from scratch, so callers need not know which happened. `keep_session=False` with a held key
    continues it one last time and releases it when the turn ends. `RolloutEngine.end_sessions` releases
    held keys early.
    """

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | int = 0
    seed_index: int | None = None
    session_id: Hashable | None = None
    keep_session: bool = False
    resume: Resume | None = None  # continue a sample an earlier call stopped (`Cutoff`); needs n=1, no session

    def __post_init__(self) -> None:
        if self.keep_session and self.session_id is None:
            raise ValueError(f"request {self.request_id!r}: keep_session=True needs a session_id to keep the KV under")
        if self.resume is not None and (self.params.n != 1 or self.session_id is not None):
            raise ValueError(f"request {self.request_id!r}: a resumed sample is one sequence without a session "
                             f"(n=1, session_id=None; got n={self.params.n}, session_id={self.session_id!r})")


@dataclass
class KVStats:
    """What the KV cache did for one generated sequence."""

    peak_slots: int = 0  # most slots this sequence held at once (per layer)
    retained_tokens: int = 0  # slots held at the end (per layer)
    total_tokens: int = 0  # prompt + response length: what a dense cache would hold
    compressions: int = 0
    compress_s: float = 0.0
    retractions: int = 0  # times the engine took this sequence's KV back and prefilled it again
    reused_tokens: int = 0  # prompt tokens whose KV came from a held session instead of a prefill
    # Number of tokens generated before each compression: token k (0-based) onward was sampled from the
    # compressed cache. Empty for a dense cache and for engines that do not report it.
    compressed_at: list[int] = field(default_factory=list)
    kv_budget: int | None = None  # the compression budget the sequence ran under (None: dense, or not reported)


@dataclass
class Generation:
    """One sampled completion. `logp_sparse[i]` is the sampler's log-prob of `token_ids[i]`."""

    request_id: str | int
    sample_index: int  # 0..n-1 within its request
    prompt_token_ids: list[int]
    token_ids: list[int]
    logp_sparse: list[float]
    finish_reason: FinishReason
    text: str | None = None
    kv: KVStats = field(default_factory=KVStats)
    session_id: Hashable | None = None  # the key the engine holds this sample's KV under; None when not held


def eos_ids(*sources) -> frozenset[int]:
    """The union of the EOS ids named by `sources` (each an int, a list of ints, or None): every engine's default
    stop set, from the model's generation config, its config and the tokenizer, in that order."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return frozenset(ids)
