"""`auto` precision and CPU threads: choose what the hardware does fast, say why, once.

`model.compute_dtype`, `rollout.dtype` (and the benchmarks' `--dtype`) default to `auto`:
- CUDA: bfloat16 where the device supports it (`torch.cuda.is_bf16_supported()`), float32 otherwise;
- CPU: bfloat16 only where the CPU has native bf16 matmuls (oneDNN's bf16 check: AVX512-BF16 or AMX) *and* a
  short matmul probe of the actor's three GEMM layouts (forward, and the two of backward) runs bf16 at least
  `BF16_MIN_SPEEDUP` as fast as fp32; float32 otherwise. Without native bf16 a CPU emulates it and runs the
  default model's matmuls tens of times slower than fp32.
float16 is never chosen automatically (it needs loss scaling). An explicit dtype always wins. Under torchrun
the ranks agree (the widest choice wins: if any rank resolves to fp32, all do), so the actor and the engines
of every rank run one precision. The resolved values replace `auto` in the config before `config.yaml` is
written.

CPU threads: torchrun sets OMP_NUM_THREADS=1 for every process when it starts more than one, which on a
many-core machine leaves most cores idle. `cpu_threads()` gives each local process its share of the cores this
process may run on, unless the user set OMP_NUM_THREADS to something other than torchrun's 1.

Left out on purpose: fp16 autocast and fp8 (explicit only), per-layer precision, probing GPUs (their bf16
support is reported by the driver), and NUMA pinning.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from sparserl.utils.logging import log0

BF16_MIN_SPEEDUP = 0.8  # bf16 must run the probe at least this fast relative to fp32 (1.0 = equal)
_PROBE_SHAPE = (256, 576, 1536)  # tokens x hidden x intermediate: a 135M-class MLP matmul


@dataclass(frozen=True)
class Choice:
    dtype: str  # bfloat16 | float32
    reason: str


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _probe_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k, n = _PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (m, n)))


def _time_matmuls(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.nn.functional.linear(x, w)  # forward: x @ w.T
    dy @ w  # grad of the input
    dy.t() @ x  # grad of the weight
    return time.perf_counter() - t0


def probe_cpu_bf16_speedup(rounds: int = 5) -> float:
    """fp32 time / bf16 time of the probe (> 1: bf16 is faster): the best of `rounds` runs of each, taken in
    turns, so that a burst of load on a shared machine slows both sides instead of flipping the answer (timed one
    dtype after the other, a busy moment once made an AMX CPU's bf16 look slower than fp32 in one call and
    faster in the next)."""
    inputs = {dtype: _probe_inputs(dtype) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in inputs}
    for round_ in range(rounds + 1):  # round 0 warms both kernels up
        for dtype, tensors in inputs.items():
            seconds = _time_matmuls(*tensors)
            if round_:
                best[dtype] = min(best[dtype], seconds)
    return best[torch.float32] / best[torch.bfloat16]


def choose_auto(device: torch.device | str, *, native_bf16: bool | None = None, speedup: float | None = None) -> Choice:
    """What `auto` means on this device. `native_bf16` / `speedup` override the CPU checks (tests)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice("bfloat16", f"{torch.cuda.get_device_name(dev)} supports bf16")
        return Choice("float32", f"{torch.cuda.get_device_name(dev)} has no bf16 support (fp16 is never chosen automatically)")
    if dev.type != "cpu":
        return Choice("float32", f"no bf16 rule for device type {dev.type!r}")
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    if not native:
        return Choice("float32", f"this CPU has no native bf16 matmuls (capability {torch.backends.cpu.get_cpu_capability()}; "
                                 "bf16 would be emulated, many times slower than fp32)")
    ratio = probe_cpu_bf16_speedup() if speedup is None else speedup
    if ratio < BF16_MIN_SPEEDUP:
        return Choice("float32", f"native bf16, but a matmul probe ran it at {ratio:.2f}x the fp32 speed")
    return Choice("bfloat16", f"native bf16 matmuls ({ratio:.2f}x the fp32 speed in a probe)")


def resolve(value: str, auto: Choice) -> str:
    return auto.dtype if value == "auto" else value


def agree(choice: Choice) -> Choice:
    """The same choice on every rank: float32 if any rank chose it (a no-op outside torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choice
    wants_fp32 = torch.tensor([float(choice.dtype == "float32")])
    if dist.get_backend() == "nccl":
        wants_fp32 = wants_fp32.cuda()
    dist.all_reduce(wants_fp32, op=dist.ReduceOp.MAX)
    if wants_fp32.item() and choice.dtype != "float32":
        return Choice("float32", "another rank chose float32 (" + choice.reason + " here)")
    return choice


def cpu_threads(local_world_size: int | None = None) -> int:
    """Threads for one CPU process: OMP_NUM_THREADS when the user set it (other than torchrun's 1), else this
    process's usable cores split evenly over the local processes."""
    env = os.environ.get("OMP_NUM_THREADS")
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if env and not (env == "1" and local > 1):
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local))


def resolve_precision(cfg, device: torch.device) -> None:
    """The run's config (`cfg.model.compute_dtype`, `cfg.rollout.dtype`) with `auto` replaced by what this hardware
    runs fast (the same on every rank), the CPU thread count set, and both said once. Both entry points call it
    (training's setup and `python -m sparserl.eval`) before the config is written."""
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads())
    keys = [k for k, v in (("model.compute_dtype", cfg.model.compute_dtype), ("rollout.dtype", cfg.rollout.dtype)) if v == "auto"]
    if keys:
        choice = agree(choose_auto(device))
        cfg.model.compute_dtype = resolve(cfg.model.compute_dtype, choice)
        cfg.rollout.dtype = resolve(cfg.rollout.dtype, choice)
        log0(f"precision: {', '.join(keys)}=auto -> {choice.dtype}: {choice.reason}")
    if device.type == "cpu":
        log0(f"cpu threads per process: {torch.get_num_threads()}")


def resolve_arg(value: str, device: torch.device | str | None = None) -> str:
    """A benchmark's `--dtype`: `auto` resolved for `device` (default: CUDA when visible, else CPU), printed once."""
    if value != "auto":
        return value
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    choice = choose_auto(device)
    print(f"precision: --dtype auto -> {choice.dtype}: {choice.reason}", flush=True)
    return choice.dtype
