"""The rollout engine protocol: what the trainer, the evaluation and the env loop may call on any engine.

An engine turns `GenerationRequest`s into `Generation`s, takes fresh weights from the actor, and can give
its memory back while the actor trains. Engines agree only on `engines/types.py`; each is built from its own
options dataclass (the trainer's setup maps the run's config onto it), never from the run's `Config`.

Multi-turn sessions are optional: an engine with `supports_sessions = True` (native) keeps a trajectory's
KV cache between turns and prefills only the new tokens; one without (SGLang, which re-prefills and lets its
prefix cache help) ignores `session_id` / `keep_session`, returns `Generation.session_id = None`, and its
`end_sessions` does nothing. Either way the caller sends the full history every turn, so the samples are the
same; `supports_sessions(engine)` reads the flag of any engine, including duck-typed ones without it.
Engines by name (the built-in ones and those a user registers) are `engines/registry.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Protocol, runtime_checkable

import torch

from sparserl.engines.types import Generation, GenerationRequest


@dataclass
class EngineStats:
    """Counters of the engine since the last `reset_stats()`; they become the trainer's `kv/*` and `perf/*`."""

    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # tokens run through a prefill forward (shared-prefill copies and held session KV are not); 0 where not counted
    generate_s: float = 0.0
    forward_steps: int = 0
    peak_slots: int = 0  # high-water mark of the slot pool (slots per layer)
    pool_slots: int = 0
    peak_running: int = 0  # most sequences decoding at once
    running_sum: int = 0  # sequences in each forward step, summed over the steps (mean running = / forward_steps)
    retractions: int = 0  # running sequences that gave their KV back and were prefilled again (native engine)
    recomputed_tokens: int = 0  # tokens whose KV those re-prefills computed again
    compressions: int = 0
    compress_s: float = 0.0
    kv_bytes_per_slot: int = 0  # all layers, K and V
    sessions_continued: int = 0  # turns that continued a held session's KV instead of re-prefilling
    session_reused_tokens: int = 0  # prompt tokens those turns did not prefill
    sessions_dropped: int = 0  # held sessions dropped under pool pressure (their next turn re-prefills)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_slots * self.kv_bytes_per_slot

    @property
    def mean_running(self) -> float:
        """Sequences per forward step, on average (0 where the engine does not count them)."""
        return self.running_sum / self.forward_steps if self.forward_steps else 0.0

    @property
    def tok_per_s(self) -> float:
        return self.new_tokens / self.generate_s if self.generate_s > 0 else 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    supports_sessions: bool  # True: `keep_session` / `session_id` keep and continue KV between turns

    def generate(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None) -> list[Generation]:
        """Complete every request `params.n` times; returns generations ordered by (request, sample index).
        `progress(k)` is called as k more sequences finish."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by parameter name, in place."""

    def sleep(self) -> None:
        """Free the KV pool (and whatever else the backend can) until `wake()`."""

    def wake(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def reset_stats(self) -> None: ...

    def end_sessions(self, session_ids: Iterable[Hashable] | None = None) -> int:
        """Release the KV held for these session keys (None: every session); unknown keys are ignored.
        Returns how many were held. A no-op returning 0 where sessions are not supported."""

    def set_seed(self, seed: int) -> None:
        """The base of every sample's stream from now on (requests whose `params.seed` is set keep theirs):
        sample j of the request at seed index i draws from `utils.seed.sample_seed(seed, i, j)` in every engine."""

    def close(self) -> None:
        """Give back everything the engine holds (memory, threads, subprocesses); the engine is unusable after.
        Safe to call twice."""


def supports_sessions(engine: Any) -> bool:
    """Whether `engine` keeps KV between turns; False for engines that do not declare it."""
    return bool(getattr(engine, "supports_sessions", False))


def supports_partial(engine: Any) -> bool:
    """Whether `engine` stops a call early (`generate(..., cutoff=)`) and resumes a stopped sample
    (`GenerationRequest.resume`): partial rollouts (sparserl/rollout/partial.py); the native engine does."""
    return bool(getattr(engine, "supports_partial", False))
