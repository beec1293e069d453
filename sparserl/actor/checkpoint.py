"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and resume.

`output_dir/checkpoints/step_<N>/` holds the DCP shards of model + optimizer, `trainer_rank<r>.pt` with each
rank's LR-scheduler, data position and RNG state, and `COMPLETE` once every rank has written. A folder
without `COMPLETE` (an interrupted save) is ignored by `resume=auto` and replaced by the next save.
Left out on purpose: keeping only the last k checkpoints, async saves.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sparserl.utils.errors import UserError


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def save(output_dir: str | Path, step: int, model, optimizer, extra: dict, rank: int) -> Path:
    path = checkpoint_dir(output_dir, step)
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    torch.save(extra, path / f"trainer_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (path / "COMPLETE").write_text(str(step))
    _barrier()
    return path


def latest(output_dir: str | Path) -> Path | None:
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "COMPLETE").exists()) if root.exists() else []
    return done[-1] if done else None


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    if resume in ("", "none", None):
        return None
    if resume == "auto":
        return latest(output_dir)
    p = Path(resume)
    if not (p / "COMPLETE").exists():
        raise UserError(f"trainer.resume={resume}: not a complete sparserl checkpoint folder")
    return p


def load(path: Path, model, optimizer, rank: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_file = path / f"trainer_rank{rank}.pt"
    if not extra_file.exists():
        raise UserError(f"{path} has no {extra_file.name}: it was saved with a different number of processes")
    return torch.load(extra_file, weights_only=False)
