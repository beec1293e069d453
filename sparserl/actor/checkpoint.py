"""Sharded checkpoints with torch.distributed.checkpoint (DCP): crash-safe saves, safe loads, elastic resume.

Layout: `output_dir/checkpoints/step_<N>/` holds the DCP shards of model + optimizer, `trainer_state.pt` (the
step, LR scheduler and data position, and the settings a resume checks or keeps (trainer/resume.py): the same on
every rank, written by rank 0) and `COMPLETE`. By default the trainer saves every 10 steps and keeps the newest 3
(`trainer.save_every`, `trainer.keep_last`).

Crash safety. A save goes to `checkpoints/.step_<N>.tmp/`; once every rank has written and `COMPLETE` is in
it, rank 0 renames it into place. A re-save of an existing step first renames the old folder aside, so a
complete checkpoint of any step exists at every moment; a folder without `COMPLETE`, or a hidden `.tmp` /
`.old` folder, is never resumed from and is swept by the next save. `keep_last` (`trainer.keep_last`) prunes
older complete checkpoints only after the new one is in place.

Elastic resume. Nothing in a checkpoint depends on the number of processes: DCP reshards model and optimizer
onto any mesh, `trainer_state.pt` is one file, and the random streams are re-derived from (seed, step) at
every step instead of being saved (sparserl/utils/seed.py `seed_step`).

Safe loading. `trainer_state.pt` is read with `torch.load(weights_only=True)`: only tensors, numbers,
strings and containers of them load; a file that would unpickle anything else (which can run code) is
refused with a one-line error.

LoRA actors (actor.lora.rank > 0, actor/lora.py). When some parameters are frozen, a checkpoint holds only the
trained ones (the adapters) and their optimizer state: the frozen base is `model.path` itself and is read from there
on resume. Resuming a checkpoint whose tensors do not match this run's (LoRA into full fine-tuning, another rank or
other target modules) is a one-line error naming both.

Left out on purpose: async saves, and checkpoints on storage other than a filesystem shared by all ranks.
"""
from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sparserl.utils.errors import UserError, one_line

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (a `step_N` folder with `COMPLETE`), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "COMPLETE").exists()]
    return [p for _, p in sorted(found)]


def _sweep(root: Path, keep: Path | None = None) -> None:
    """Remove leftovers of interrupted saves: hidden temporary folders and incomplete step folders."""
    for p in root.iterdir():
        if p == keep:
            continue
        hidden = p.name.startswith(".step_")
        incomplete = _STEP_DIR.match(p.name) and not (p / "COMPLETE").exists()
        if p.is_dir() and (hidden or incomplete):
            shutil.rmtree(p, ignore_errors=True)


def save(output_dir: str | Path, step: int, model, optimizer, state: dict, rank: int, keep_last: int = 0,
         extra: dict | None = None) -> Path:
    """Write a checkpoint of `step` (a collective: every rank calls it); returns its folder.

    `state` (plain data: numbers, strings, tensors) is rank 0's and is written once. With `keep_last` > 0 only
    that many complete checkpoints remain afterwards, the new one included. `extra`: name -> (model, optimizer) of
    other sharded models of the run (the critic), saved beside the actor's shards under `name` and `name`_optim."""
    final = checkpoint_dir(output_dir, step)
    root = final.parent
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _sweep(root)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    shards = {"model": _trained(model, model_sd), "optim": optim_sd}
    for name, (m, opt) in (extra or {}).items():
        shards[name], shards[f"{name}_optim"] = get_state_dict(m, opt)
    dcp.save(shards, checkpoint_id=str(tmp))
    if rank == 0:
        torch.save(state, tmp / STATE_FILE)
    _barrier()
    if rank == 0:
        (tmp / "COMPLETE").write_text(str(step))
        old = root / f".{final.name}.old"
        if final.exists():  # a re-save of this step: the complete old one stays until the new one is in place
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last > 0:
            for p in complete_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def latest(output_dir: str | Path) -> Path | None:
    done = complete_checkpoints(output_dir)
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


def read_state(path: Path) -> dict:
    """`trainer_state.pt` of a checkpoint, loaded with weights_only=True; anything else is a UserError."""
    state_file = path / STATE_FILE
    if not state_file.exists():
        raise UserError(f"{path} has no {STATE_FILE}: not a checkpoint of this version of sparserl")
    try:
        return torch.load(state_file, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
        raise UserError(f"refusing to load {state_file}: it holds more than plain tensors, numbers and strings "
                        f"(loading it could run code) or is damaged: {one_line(e)[:200]}") from None


def load(path: Path, model, optimizer, extra: dict | None = None) -> dict:
    """Load model + optimizer (resharded onto this run's mesh, whatever the saving world size) and return
    the trainer state. The trainer state is read first, so an unsafe checkpoint is refused before any shard
    is touched. `extra` as `save` takes it: a name the checkpoint lacks is a UserError."""
    state = read_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    trained = _trained(model, model_sd)
    _check_tensors(path, trained)
    shards = {"model": trained, "optim": optim_sd}
    extra = extra or {}
    if extra:
        saved = {k.split(".", 1)[0] for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}
        for name in extra:
            if name not in saved:
                raise UserError(f"trainer.resume={path}: the checkpoint holds no {name} (saved without one, "
                                f"{name}.enable=false); resume with the settings it was saved with, or start a new run")
    for name, (m, opt) in extra.items():
        shards[name], shards[f"{name}_optim"] = get_state_dict(m, opt)
    dcp.load(shards, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"],
                   options=StateDictOptions(strict=len(trained) == len(model_sd)))
    for name, (m, opt) in extra.items():
        set_state_dict(m, opt, model_state_dict=shards[name], optim_state_dict=shards[f"{name}_optim"])
    return state


def _trained(model, model_sd: dict) -> dict:
    """The model state a checkpoint holds: all of it, or only the trained parameters when some are frozen (LoRA)."""
    params = dict(model.named_parameters())
    if all(p.requires_grad for p in params.values()):
        return model_sd
    return {k: v for k, v in model_sd.items() if k in params and params[k].requires_grad}


def _check_tensors(path: Path, want: dict) -> None:
    """A UserError when the checkpoint's model tensors are not the ones this run trains (names and shapes)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in meta.items() if k.startswith("model.") and hasattr(m, "size")}
    adapters = lambda keys: any(".lora_A." in k for k in keys)  # noqa: E731
    if adapters(saved) != adapters(want):
        what = {True: "LoRA adapters (actor.lora.rank > 0)", False: "a fully fine-tuned model (actor.lora.rank=0)"}
        raise UserError(f"trainer.resume={path}: the checkpoint holds {what[adapters(saved)]}, but this run trains "
                        f"{what[adapters(want)]}; resume with the settings it was saved with")
    if not adapters(want):
        return  # full fine-tuning: DCP itself names a missing tensor
    missing = sorted(set(want) - set(saved))
    if missing:
        raise UserError(f"trainer.resume={path}: the checkpoint lacks {len(missing)} tensor(s) this run trains, e.g. "
                        f"{missing[0]} (another model, or other actor.lora.target_modules?)")
    for k, t in want.items():
        if tuple(t.shape) != saved[k]:
            raise UserError(f"trainer.resume={path}: {k} is {list(saved[k])} in the checkpoint but {list(t.shape)} in "
                            "this run (another model, or another actor.lora.rank?)")
