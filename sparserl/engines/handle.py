"""One handle on a rollout engine for the code that drives it (the trainer, the evaluation): who runs it, when it is
awake, and which weights it holds.

With tp or cp > 1 the ranks of one data-parallel replica work on the same samples: the replica group's owner (its
first rank, `parallel.ReplicaGroup`) runs the engine and the env loop, and its peers receive what the owner
produced (`on_owner`). Every rank still joins the weight sync (its gathers are collectives) and puts its engine to
sleep (a peer's never woke; sleeping still drops its weights under `rollout.release_weights`). The calls:
  - `wake(fresh_stats)`: the owner's engine up for a rollout (nothing on a peer); `fresh_stats` also restarts the
    counters a step logs (`reset_stats`);
  - `sleep()`: every rank's engine gives its KV memory (and weights, where the backend can) back, and the
    allocator returns the freed pages to the system (`utils.memory.release_free_memory`);
  - `sync()`: the actor's full weights into the engine (`weight_sync.sync_weights`, a collective);
  - `wake_again(timer)`: a second wake within one step (a later dynamic-sampling round, the rescue): when the sleep
    dropped the weights (`release_weights`) they are pushed again first, inside `timer`;
  - `on_owner(fn)`: `fn(engine)` on the owner, its result on every rank of the replica group.
The engine itself stays reachable as `handle.engine` for what only the owner's calls need (seeds, dense mode,
stats), which run inside `on_owner`.
Left out on purpose: driving an engine in another process or on another machine (engines here live in the
training processes).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, TypeVar

import torch

from sparserl.engines.weight_sync import sync_weights
from sparserl.utils.memory import release_free_memory

T = TypeVar("T")


class EngineHandle:
    def __init__(self, engine: Any, replica: Any = None,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
                 release_weights: bool = False) -> None:
        """`replica`: this rank's `parallel.ReplicaGroup` (None: the rank owns its engine alone). `weights`: what
        `sync` pushes, called anew each time (the actor's `full_state`). `release_weights`: whether `sleep` drops
        the engine's weights (`rollout.release_weights`)."""
        self.engine, self.replica, self.weights, self.release_weights = engine, replica, weights, release_weights

    @property
    def is_owner(self) -> bool:
        return self.replica is None or self.replica.is_owner

    @property
    def num_slots(self) -> int | None:
        return getattr(self.engine, "num_slots", None)

    def wake(self, fresh_stats: bool = False) -> None:
        if self.is_owner:
            self.engine.wake()
            if fresh_stats:
                self.engine.reset_stats()

    def sleep(self) -> None:
        self.engine.sleep()
        release_free_memory()

    def sync(self) -> dict[str, float]:
        assert self.weights is not None, "a handle built without weights has nothing to push"
        return sync_weights(self.weights(), self.engine)

    def wake_again(self, timer: AbstractContextManager | None = None) -> None:
        if self.release_weights:
            with timer if timer is not None else nullcontext():
                self.sync()
        self.wake()

    def on_owner(self, fn: Callable[[Any], T]) -> T:
        result = fn(self.engine) if self.is_owner else None
        return result if self.replica is None else self.replica.from_owner(result)

    def set_kv_budget(self, budget: int) -> None:
        self.engine.set_kv_budget(budget)

    def close(self) -> None:
        self.engine.close()
