"""Preemption, the non-finite stop, and fault drills: how a run ends when the world interrupts it.

Preemption. The signals in `trainer.preempt_signals` (default SIGTERM and SIGUSR1) only raise a flag; the
step in progress finishes, then every rank learns whether ANY rank was signalled (one all-reduce of the flag
per step, so no rank is left waiting in a collective), all save the checkpoint of that step and exit with
`PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL: "try again"), which a job script can test to requeue the run with
`trainer.resume=auto`. SIGINT (Ctrl-C) acts the same the first time; a second SIGINT exits at once.

torchrun itself, when signalled, forwards SIGTERM to its workers and kills them 30 s later: send the signal
to the worker processes (what SLURM `--signal` and `scancel --signal` do), or give a scheduler's early
warning signal (e.g. SIGUSR1) enough lead time for one step and one save.

Fault drills. `SPARSERL_FAULT=nan_loss:STEP:RANK` turns rank RANK's advantages into NaN at training step
STEP, so the non-finite guard (sparserl/actor/actor.py `_step`) can be exercised on a real run.

Left out on purpose: saving in the middle of a step (a rollout's partial results are not resumable), and
handling a signal that arrives while a checkpoint is being written (the save finishes first).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sparserl.utils.errors import RunStopped

PREEMPTED_EXIT_CODE = 75


class Preemption:
    """Signal handlers that set a flag, and the per-step collective that tells every rank about it."""

    def __init__(self, signal_names: list[str], device: torch.device) -> None:
        self.device = device
        self.signalled: str | None = None
        self._interrupts = 0
        for name in signal_names:
            signal.signal(getattr(signal, name), self._on_signal)
        signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name

    def _on_interrupt(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            print("second SIGINT: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        self._on_signal(signum, frame)

    def requested(self) -> bool:
        """True on every rank when any rank has been signalled (a collective: all ranks call it each step)."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def check_skips(consecutive: int, limit: int, step: int, output_dir: str | Path) -> None:
    """Stop the run (every rank sees the same count) after `limit` optimizer steps in a row were skipped."""
    if limit <= 0 or consecutive < limit:
        return
    from sparserl.actor.checkpoint import latest

    good = latest(output_dir)
    where = f"the last good checkpoint is {good} (trainer.resume=auto continues from it)" if good else "no checkpoint was saved yet"
    raise RunStopped(f"step {step}: {consecutive} optimizer steps in a row had a non-finite loss or gradient norm and were "
                     f"skipped (trainer.max_skipped_steps={limit}); {where}")


def injected_nan(step: int, rank: int) -> bool:
    """Whether the `SPARSERL_FAULT=nan_loss:STEP:RANK` drill targets this step and rank."""
    spec = os.environ.get("SPARSERL_FAULT", "")
    if not spec.startswith("nan_loss:"):
        return False
    steps, ranks = spec.split(":")[1:3]
    return str(step) in steps.split(",") and str(rank) in ranks.split(",")
