"""The env loop's vocabulary, shared by the worker and the env drivers: a `Sample` (one trajectory), an
`Opening` (a trajectory as its env started it), the `EnvDriver` interface, and env calls under a time limit
and a concurrency cap (`EnvCalls`).

Left out on purpose: the loop itself (worker.py) and any env kind (env_module.py, openreward/).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparserl.data.dataset import PromptRow
from sparserl.engines.types import Generation, KVStats


@dataclass
class Sample:
    """One trajectory. All samples of a prompt share `group` and sit next to each other."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # model and env tokens, in order
    loss_mask: list[int] = field(default_factory=list)  # 1 = model token, 0 = env token
    logp_sparse: list[float] = field(default_factory=list)  # sampler log-probs; 0.0 at env tokens
    reward: float = 0.0
    score: float = 0.0
    status: str = "ok"  # ok | truncated | error | timeout | aborted
    num_turns: int = 0
    finish_reason: str = ""  # the last model turn's: "length" = cut by a length limit (algo.overlong)
    turn_lens: list[int] = field(default_factory=list)  # model tokens of each turn, in order
    kv: list[KVStats] = field(default_factory=list)
    compressed_at: list[int] = field(default_factory=list)  # response positions of the first token after each compression
    extra_info: dict[str, Any] = field(default_factory=dict)
    tool_stats: dict[str, int] = field(default_factory=dict)  # tool envs: calls, malformed, errors, failed
    # Partial rollouts (rollout/partial.py): the training step that drew each response token; empty: all drawn in the
    # step that trains on the sample
    drawn_at: list[int] = field(default_factory=list)


@dataclass
class Opening:
    """A trajectory as its env opened it."""

    prompt_ids: list[int]  # may be empty where the opening failed
    status: str | None = None  # None: open; else the status it ends with before any generation
    error: str = ""  # why it failed, for the log
    max_turns: int | None = None  # None: the rollout's max_turns


class EnvDriver(Protocol):
    """What the loop needs from an env. Trajectory `k` is sample `k % n` of row `k // n`."""

    async def open(self, rows: list[PromptRow], prompt_texts: list[str], n: int) -> list[Opening]: ...

    async def step(self, k: int, sample: Sample, gen: Generation, action: str, last_turn: bool) -> list[int] | None:
        """Book the env's answer to this turn into `sample` (reward, score, status); return the observation
        tokens to append, or None when the trajectory ends here. Raises on env errors."""

    async def close(self, ks: list[int] | None) -> None:
        """Release what trajectories `ks` (None: all) hold; never raises, returns within a bounded time."""

    def metrics(self, samples: list[Sample]) -> dict[str, float]: ...


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt: the text carries its own special tokens; a BOS is added only where the
    tokenizer normally adds one and the text lacks it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and getattr(tokenizer, "add_bos_token", False) and not text.startswith(bos):
        ids = [tokenizer.bos_token_id] + ids
    return ids


class EnvTimeout(Exception):
    """An env call that did not return within `env.step_timeout_s`."""


class EnvCalls:
    """Env calls under a time limit and a cap on how many run at once (`env.step_timeout_s`, `env.max_concurrency`).

    A call past its limit is cancelled and its sample ends with status "timeout". Only awaiting calls can be
    cancelled: an env that blocks the event loop (sleeps or computes without awaiting) must move that work to
    a thread (`asyncio.to_thread`) for the limit to apply."""

    def __init__(self, timeout_s: float | None, max_concurrency: int | None) -> None:
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.gate = asyncio.Semaphore(max_concurrency) if max_concurrency and max_concurrency > 0 else None

    async def __call__(self, what: str, coro):
        if self.gate is None:
            return await self._timed(what, coro)
        async with self.gate:
            return await self._timed(what, coro)

    async def _timed(self, what: str, coro):
        try:
            return await asyncio.wait_for(coro, self.timeout_s)
        except asyncio.TimeoutError:
            raise EnvTimeout(f"env.{what} did not return within env.step_timeout_s={self.timeout_s:g}") from None


def last_turn_len(sample: Sample) -> int:
    """Model tokens of the sample's last turn: the one a length limit can cut (a cut turn ends the episode). A
    sample built without per-turn lengths counts all its model tokens."""
    return sample.turn_lens[-1] if sample.turn_lens else sum(sample.loss_mask)


def cut_by_length(sample: Sample) -> bool:
    """Whether the sample's last model turn ended at a length limit (`rollout.max_new_tokens`, or the room left in
    the context) instead of at EOS or a stop string."""
    return sample.finish_reason == "length"


def failure_status(e: BaseException) -> str:
    return "timeout" if isinstance(e, EnvTimeout) else "error"


def row_extra(row: PromptRow) -> dict[str, Any]:
    """What a trajectory's `extra_info` starts as: the row's extra fields, its answer and its index."""
    return {**row.extra, "answer": row.answer, "index": row.index}
