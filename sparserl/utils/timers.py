"""Named wall-clock timers for the phases of a training step.

    timers = Timers()
    with timers("rollout"):
        ...
    metrics.update(timers.pop())   # {"perf/rollout_s": 8.1, ...}, then reset

CUDA work is asynchronous, so the device is synchronized before each clock read when CUDA has been
initialized; otherwise a phase would be charged for kernels launched by the phase before it.

Left out on purpose: per-rank reductions (each rank reports its own times; rank 0 logs), CUDA events,
nested timers of the same name, and histograms.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


def _sync() -> None:
    # is_initialized: never create a CUDA context just to time a CPU run.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timers:
    """With `memory` (a `utils.memory.PhasePeaks`), each phase also reports its peak memory as `mem/<name>_peak_gb`
    and the memory in use when it ended as `mem/<name>_end_gb`: in phase order, a coarse timeline of the step."""

    def __init__(self, memory=None) -> None:
        self._seconds: dict[str, float] = {}
        self._peaks: dict[str, float] = {}
        self._ends: dict[str, float] = {}
        self._running: set[str] = set()
        self.memory = memory

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        assert name not in self._running, f"timer {name!r} is already running"
        self._running.add(name)
        _sync()
        if self.memory is not None:
            self.memory.start()
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            elapsed = time.perf_counter() - start
            self._running.discard(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed
            if self.memory is not None:
                self._peaks[name] = max(self._peaks.get(name, 0.0), self.memory.stop())
                self._ends[name] = self.memory.current()

    def pop(self) -> dict[str, float]:
        """Accumulated seconds as `{"perf/<name>_s": seconds}` (and `mem/<name>_peak_gb`); resets all timers."""
        out = {f"perf/{name}_s": seconds for name, seconds in self._seconds.items()}
        out.update({f"mem/{name}_peak_gb": gb for name, gb in self._peaks.items()})
        out.update({f"mem/{name}_end_gb": gb for name, gb in self._ends.items()})
        self._seconds, self._peaks, self._ends = {}, {}, {}
        return out
