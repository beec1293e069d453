"""Rank-0 logging: `metrics.jsonl`, a one-line console summary per step, optional wandb, progress bars.

`metrics.jsonl` holds one JSON object per step (`{"step": 3, "reward/mean": 0.31, ...}`); each line is
flushed and fsync'd so a crash loses nothing already logged. NaN and inf become `null`, keeping every line
valid JSON. On resume, `truncate_after(step)` drops the lines of steps that the checkpoint does not cover
(and a half-written last line); a fresh run reusing an output dir clears the file with `truncate_after(-1)`.

wandb is imported only when `wandb_mode` is "offline" or "online"; if it is missing, one warning line is
printed and the file and console logging go on.

Left out on purpose: TensorBoard and other backends, metric reductions across ranks (callers reduce before
logging), and log levels (`log0` is a flushed print on rank 0).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sparserl.utils.errors import UserError

WANDB_MODES = ("disabled", "offline", "online")


def get_rank() -> int:
    """Rank from torch.distributed if initialized, else env RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def log0(msg: str) -> None:
    if get_rank() == 0:
        print(msg, flush=True)


def to_json_value(key: str, value: Any) -> Any:
    """A JSON-safe scalar: tensors and numpy scalars become numbers, NaN/inf become None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar")
        value = float(value.detach().item())
    elif hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log numbers or strings")


def format_step_line(step: int, metrics: dict[str, Any], total_steps: int | None = None) -> str:
    """One console line from whichever standard keys are present and not None."""
    m = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    if "reward/mean" in m:
        std = f"±{m['reward/std']:.2f}" if "reward/std" in m else ""
        parts.append(f"reward {m['reward/mean']:.3f}{std}")
    for key in sorted(k for k in m if k.startswith("eval/") and k.split("/")[-1].startswith("avg@")):
        parts.append(f"eval {key.split('/')[1]} {key.split('/')[-1]} {m[key]:.3f}")  # eval/<set>/avg@<n>
    if "response/len_mean" in m:
        parts.append(f"len {m['response/len_mean']:.1f}")
    if "mismatch/kl" in m:
        parts.append(f"kl(mismatch) {m['mismatch/kl']:.1e}")
    if "correction/rejected_seq_frac" in m:
        parts.append(f"rejected {m['correction/rejected_seq_frac']:.1%}")
    if "kv/retained_frac" in m:
        parts.append(f"kv {m['kv/retained_frac']:.1%}")
    if "actor/loss" in m:
        parts.append(f"loss {m['actor/loss']:.3g}")
    if "actor/grad_norm" in m:
        parts.append(f"gnorm {m['actor/grad_norm']:.3g}")
    if "perf/step_s" in m:
        rollout = f" (rollout {m['perf/rollout_s']:.1f})" if "perf/rollout_s" in m else ""
        parts.append(f"{m['perf/step_s']:.1f} s{rollout}")
    return " | ".join(parts)


class MetricsLogger:
    """Per-step metrics to `output_dir/metrics.jsonl`, stdout and (optionally) wandb; no-op off rank 0."""

    def __init__(self, output_dir: Path, rank: int, config: dict | None, wandb_mode: str = "disabled",
                 wandb_project: str = "sparserl", wandb_name: str | None = None, console: bool = True,
                 total_steps: int | None = None) -> None:
        if wandb_mode not in WANDB_MODES:
            raise UserError(f"logger.wandb.mode must be one of {', '.join(WANDB_MODES)}; got {wandb_mode!r}")
        self.enabled = rank == 0
        self.console = console
        self.total_steps = total_steps
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file = None
        self._wandb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._wandb = _start_wandb(wandb_mode, wandb_project, wandb_name, config, Path(output_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({k: to_json_value(k, v) for k, v in metrics.items() if k != "step"})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self.console:
            print(format_step_line(step, record, self.total_steps), flush=True)
        if self._wandb is not None:
            values = {k: v for k, v in record.items() if k != "step" and v is not None}
            self._wandb.log(values, step=int(step))

    @property
    def wandb_run(self):
        """The wandb run on rank 0 when wandb is on, else None (other loggers add their own panels to it)."""
        return self._wandb

    def truncate_after(self, step: int) -> None:
        """Keep only lines with `"step" <= step`; unparseable lines (a crash mid-write) are dropped too."""
        if not self.enabled:
            return
        self._file.close()
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)  # atomic: a crash here leaves either the old or the new file
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(mode: str, project: str, name: str | None, config: dict | None, run_dir: Path):
    try:
        import wandb
    except ImportError:
        print(f"warning: logger.wandb.mode={mode} but wandb is not installed (pip install wandb); "
              "logging to metrics.jsonl only", file=sys.stderr, flush=True)
        return None
    return wandb.init(mode=mode, project=project, name=name, config=config or {}, dir=str(run_dir))


class _NullProgress:
    """Stands in for tqdm where no bar is drawn."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NullProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_enabled() -> bool:
    """SPARSERL_PROGRESS=0 turns bars off, =1 forces them on; by default only an interactive stderr has them."""
    flag = os.environ.get("SPARSERL_PROGRESS", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    return sys.stderr.isatty()


class _LineProgress(_NullProgress):
    """Progress for a log file: one plain line on stderr at most every `every_s` seconds, and one at the end."""

    def __init__(self, total: int, desc: str, every_s: float) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.t0 = self.last = time.monotonic()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.n * (self.total - self.n) if self.n else float("nan")
        pct = 100.0 * self.n / self.total if self.total else 100.0
        print(f"{self.desc}: {self.n}/{self.total} ({pct:.0f}%), {elapsed:.0f} s, eta {eta:.0f} s", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            self._line()

    def close(self) -> None:
        if time.monotonic() - self.t0 >= self.every_s:  # short work ends without a line
            self._line()


def progress(total: int, desc: str, rank: int, enabled: bool = True, lines_every_s: float = 0.0):
    """A tqdm bar on rank 0 (stderr, cleared when done), a no-op object elsewhere. Where bars are off by default
    (stderr not a terminal) and `lines_every_s` > 0, rank 0 prints a plain progress line that often instead."""
    if rank != 0 or not enabled:
        return _NullProgress()
    if not progress_enabled():
        if lines_every_s > 0 and os.environ.get("SPARSERL_PROGRESS", "").strip() != "0":
            return _LineProgress(total, desc, lines_every_s)
        return _NullProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
