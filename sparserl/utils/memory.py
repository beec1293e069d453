"""Memory of this process: current and per-phase peak, on CPU (resident set size) and CUDA (allocator).

`PhasePeaks` answers "which phase of the step holds the peak?": `Timers(memory=PhasePeaks(device))` reports
`mem/<phase>_peak_gb` next to `perf/<phase>_s`. On CUDA it reads the caching allocator's peak, reset at each
phase start. On CPU there is no allocator peak to read, so a daemon thread samples the resident set size
(`/proc/self/statm`) every `interval_s` and keeps the maximum since the phase began; a spike shorter than the
interval can be missed, which is why the whole-run `ru_maxrss` (`mem/peak_gb`) is logged as well.

`release_free_memory()` hands freed heap pages back to the OS on glibc (`malloc_trim`); the trainer calls it
between phases so the resident set follows what is live instead of the largest step so far.

`tune_malloc()` (called at start-up by the entry points) fixes glibc's mmap threshold at 1 MiB. By default glibc
raises the threshold each time a large mmapped block is freed (up to 32 MiB), after which tensors of a few MB
come from the heap, where freed blocks fragment and stay resident; with a fixed threshold every tensor of 1 MiB or
more is its own mapping, returned to the OS when freed. Measured on one actor update of the comparison workload
(SmolLM2-135M fp32, 64 sequences, activation checkpointing, 4096-token micro-batches, one process): update peak
4.59 -> 3.16 GB, of which 2.73 -> 1.30 GB above the weights and optimizer state. `MALLOC_MMAP_THRESHOLD_` in the
environment, or `SPARSERL_MALLOC_TUNE=0`, leaves glibc as it is.

The price of a fixed threshold is a page fault per 4 KiB page each time such a tensor is made: on this project's
2-core CPU an elementwise op on a fresh 25 MB tensor took several times as long as on recycled heap memory. So
`tune_malloc` also asks torch for transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`: the memory of tensors of 2 MB
or more is `madvise(MADV_HUGEPAGE)`d, one fault per 2 MB) where the kernel offers them
(`/sys/kernel/mm/transparent_hugepage/enabled` not `never`). torch reads the variable at its first CPU allocation;
the entry points call `tune_malloc` in `run_main`, after imports that allocate none (tests/process/test_entry_points.py
checks that the setting takes). On the comparison workload (benchmarks/train_step.py `--workload mawps`, one
process) the huge pages made the update faster at the same peak, while glibc's own dynamic threshold was as fast
but peaked higher (docs/performance.md).
`reuse_heap()` (around the actor's compute: the update and the log-prob passes) lifts the threshold to glibc's
largest, 32 MiB, for the duration (and the heap-top trim threshold to 64 MiB, so a block freed at the top stays
for the next one) and puts both back after (1 MiB, glibc's default 128 KiB), with a `malloc_trim`. The update's tensors are
mostly 1-32 MB (a 4096-token micro-batch's activations are 7-18 MB), freed and made again layer after layer: on the
heap they reuse the same pages, where fresh mappings fault in and zero every page each time. On the comparison
workload (one process, a 2-core Xeon; docs/performance.md) the update got faster and its peak rose but stayed below
the rollout's, which keeps the 1 MiB threshold (32 MiB for the whole run raised the rollout's peak and did not speed
decoding up).
The native engine's decode steps were not measurably faster with the heap (a 32 MiB threshold while it
generates): at batch 64 their tensors are mostly below 1 MiB, and the step is its GEMMs and its attention.
The module imports torch only where CUDA is asked about, so the entry points' start-up (`tune_malloc`) and their
one-line user errors cost no torch import.
Left out on purpose: per-tensor attribution (use torch.profiler or the CUDA memory snapshot for that).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import sys
import threading
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


_libc = None
M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
M_TRIM_THRESHOLD = -1
DEFAULT_TRIM_THRESHOLD_BYTES = 128 << 10  # glibc's default
MMAP_THRESHOLD_BYTES = 1 << 20
HEAP_REUSE_THRESHOLD_BYTES = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
_tuned = False  # tune_malloc set the threshold: reuse_heap may move it


def _glibc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    return _libc


def _huge_pages_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold and ask torch for huge pages (see the module docstring); True when it was set."""
    global _tuned
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("SPARSERL_MALLOC_TUNE", "1") == "0":
        return False
    libc = _glibc()
    if not libc or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):  # not glibc
        return False
    if _huge_pages_offered():
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    _tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return _tuned


@contextlib.contextmanager
def reuse_heap() -> Iterator[None]:
    """Tensors up to 32 MiB come from the heap inside (see the module docstring); a no-op unless `tune_malloc` set the
    threshold (not glibc, `MALLOC_MMAP_THRESHOLD_` or `SPARSERL_MALLOC_TUNE=0`: glibc stays as the user left it)."""
    libc = _glibc() if _tuned else None
    if not libc:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, HEAP_REUSE_THRESHOLD_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_REUSE_THRESHOLD_BYTES)  # a freed block at the heap's top stays for reuse
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD_BYTES)
        libc.malloc_trim(0)


def release_free_memory() -> None:
    """Return free heap memory to the OS (glibc malloc_trim; a no-op elsewhere) and drop CUDA's cached blocks."""
    libc = _glibc()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    torch = sys.modules.get("torch")  # not imported yet: no CUDA memory to give back either
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class PhasePeaks:
    def __init__(self, device: torch.device, interval_s: float = 0.1) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.interval_s = interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        event = threading.Event()
        while not event.wait(self.interval_s):
            value = rss_bytes()
            with self._lock:
                self._peak = max(self._peak, value)

    def start(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with self._lock:
            self._peak = rss_bytes()
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="sparserl-rss", daemon=True)
            self._thread.start()

    def current(self) -> float:
        """Memory in use now, GiB: allocated on CUDA, resident on CPU."""
        if self.cuda:
            import torch

            return torch.cuda.memory_allocated(self.device) / 2**30
        return rss_bytes() / 2**30

    def stop(self) -> float:
        """Peak in GiB since `start()`."""
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device) / 2**30
        value = rss_bytes()
        with self._lock:
            return max(self._peak, value) / 2**30
