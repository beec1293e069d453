"""Engine sessions: a multi-turn trajectory's KV cache held in the slot pool between turns. Plain Python.

A sequence that finishes with `keep_session` leaves its slots allocated; the engine records them here with
the tokens they hold (prompt + response, minus the last sampled token, which was never fed back) and, with
compression on, the compressor's state (`Carry`). The next turn's request under the same key must extend
those tokens; it starts with the held slots and prefills only the rest. The policy:

- Held sessions count against the pool exactly like the slots of running sequences: admission sees them.
  Under optimistic admission (scheduler.py), when the running sequences' next tokens do not fit, the same
  policy drops sessions first (`head` None below); only then are running sequences retracted. A retracted
  sequence that continued a session has lost the held slots with its own and re-prefills its whole history.
- Pool pressure: when a waiting sequence does not fit, the slots the running sequences reserve would leave
  room for it, and dropping sessions would free enough, the engine drops idle sessions, least recently used
  first, then sessions queued to continue in this very call, latest in the queue first (their sequences
  re-prefill their whole prompt). Each drop is counted (`EngineStats.sessions_dropped`); a dropped key's
  next turn is prefilled from scratch, so the caller sees the same tokens either way.
- Weights change -> held KV is stale: `update_weights` and `sleep` end every session. RL rollouts end all
  sessions at the end of the rollout anyway (`end_sessions()`).
- Errors: a `generate` that raises drops the sessions it continued or created and frees every slot it held.

Left out on purpose: sharing one held prefix between sessions (each trajectory owns its copy), forking a
held session into n samples (a continued turn has n=1), offloading held KV to host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence as Seq


@dataclass(eq=False)
class Session:
    key: Hashable
    tokens: list[int]  # the tokens whose K/V the held slots hold, in order
    slots: list[int]  # fewer than `tokens` once compressed
    carry: Any  # the compressor's `Carry`; None for a dense cache
    last_used: int


def session_keys(session_id: Hashable | None, n: int) -> list:
    """The key each sample's KV is held under: the session id itself for n=1, (id, sample index) for n>1."""
    if session_id is None:
        return []
    return [session_id] if n == 1 else [(session_id, j) for j in range(n)]


def choose_victims(idle: list[Session], waiting: Seq, head: Any, shortfall: int,
                   can_restart: Callable[[Any], bool]) -> list:
    """What to drop so that `shortfall` slots come free for `head`: idle sessions in the order given (least
    recently used first), then waiting sequences that continue a session (`reused > 0`), latest in the queue
    first, where `can_restart(seq)` says their full re-prefill fits. Empty when all of them would not suffice."""
    victims, freed = [], 0
    for session in idle:
        if freed >= shortfall:
            break
        victims.append(session)
        freed += len(session.slots)
    for seq in reversed(waiting):
        if freed >= shortfall:
            break
        if seq is head or not seq.reused or not can_restart(seq):
            continue
        victims.append(seq)
        freed += len(seq.slots)
    return victims if freed >= shortfall else []


def check_extends(held: list[int], prompt: list[int], key: Hashable, request_id: Any) -> None:
    """Raise a ValueError naming the request and the session unless `prompt` is `held` plus >= 1 new token."""
    n = len(held)
    if len(prompt) > n and prompt[:n] == held:
        return
    if prompt == held[: len(prompt)]:
        why = f"it has {len(prompt)} tokens and nothing after them to prefill"
    else:
        first = next(i for i, (a, b) in enumerate(zip(prompt, held)) if a != b)
        why = f"token {first} is {prompt[first]} where the session holds {held[first]}"
    raise ValueError(
        f"request {request_id!r}: prompt_token_ids do not extend the {n} tokens held for session {key!r} ({why}); "
        "a continued turn's prompt is the previous turn's prompt + its response + the new tokens. "
        f"Call end_sessions([{key!r}]) first to start this session over."
    )


class SessionTable:
    """The held sessions by key, with a use clock for least-recently-used eviction."""

    def __init__(self) -> None:
        self._held: dict[Hashable, Session] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def get(self, key: Hashable) -> Session | None:
        return self._held.get(key)

    @property
    def held_slots(self) -> int:
        return sum(len(s.slots) for s in self._held.values())

    def put(self, key: Hashable, tokens: list[int], slots: list[int], carry: Any) -> None:
        assert key not in self._held, f"session {key!r} is held twice"
        self._clock += 1
        self._held[key] = Session(key, tokens, slots, carry, self._clock)

    def take(self, key: Hashable) -> Session:
        """Remove a session whose slots a sequence now owns (it continues the session)."""
        return self._held.pop(key)

    def pop(self, keys: Iterable[Hashable] | None = None) -> list[Session]:
        """Remove and return the sessions under `keys` (None: all); unknown keys are skipped."""
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"give a list of session keys, not the string {keys!r}")
        if keys is None:
            out = list(self._held.values())
            self._held.clear()
            return out
        return [s for s in (self._held.pop(k, None) for k in keys) if s is not None]

    def least_recently_used(self) -> list[Session]:
        return sorted(self._held.values(), key=lambda s: s.last_used)
