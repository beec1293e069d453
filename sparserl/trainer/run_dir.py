"""Which folder a training run writes to (`trainer.output_dir`, `trainer.overwrite`) and the run id that ties its
checkpoints to that folder; the files themselves are sparserl/utils/runs.py's.

- `trainer.output_dir=auto` (the default): a new folder per run under the trainer's root (`outputs/grpo/` for GRPO,
  `outputs/sft/` for the warm start), named by its start time, and `<root>/latest` pointing to it. Rank 0 makes it
  once the processes are up and broadcasts its name, so every rank, on every node, writes to the same folder (a
  time read on each rank could differ). `trainer.resume=auto` continues the run `latest` points to instead, and
  `trainer.resume=<run>/checkpoints/step_N` that checkpoint's run folder.
- A folder given by name that already holds a run (a logged step, a checkpoint, an export: `runs.holds_run`) is
  refused before any work (trainer/preflight.py) unless the run resumes (`trainer.resume`) or
  `trainer.overwrite=true` says to start over; rank 0 then removes that run's files first.
- The run id: `run.json` in the folder and `run_id` in every checkpoint's trainer state. A resume whose checkpoint
  holds another id than the folder's is refused: the folder's metrics and samples are another run's. A resumed run
  keeps its checkpoint's id; a folder or a checkpoint from before run ids resumes as it did, unchecked.

Left out on purpose: locking a folder against two runs started into it at once (the second would still be refused
once the first has logged a step).
"""
from __future__ import annotations

from pathlib import Path

from sparserl.config import Config
from sparserl.utils import runs
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0

AUTO = "auto"
GRPO_ROOT, SFT_ROOT = "outputs/grpo", "outputs/sft"  # where `auto` puts each trainer's runs
RUN_ID = "run_id"  # the key in trainer_state.pt


def _choose_folder(cfg: Config, root: str) -> Path:
    """Rank 0's choice of the run folder (created, and `latest` moved to it, when it is a new one)."""
    t = cfg.trainer
    if t.output_dir != AUTO:
        folder = Path(t.output_dir)
        if t.overwrite and runs.holds_run(folder):
            log0(f"trainer.overwrite=true: removing the run in {folder} ({runs.contents(folder).describe()})")
            runs.remove_run(folder)
        return folder
    if t.resume == "auto":
        folder = runs.latest_run(root)
        if folder is not None:
            return folder
    elif t.resume != "none":
        ckpt = Path(t.resume)
        if ckpt.parent.name == "checkpoints" and (ckpt.parent.parent / "config.yaml").exists():
            return ckpt.parent.parent
    folder = runs.new_run_folder(root)
    runs.point_latest(root, folder)
    return folder


def resolve_output(cfg: Config, rank: int, world_size: int, root: str) -> None:
    """Set `cfg.trainer.output_dir` to this run's folder on every rank (a collective when there are several)."""
    payload: list = [None]
    if rank == 0:
        try:
            payload = [str(_choose_folder(cfg, root))]
        except (UserError, OSError) as e:
            payload = [UserError(f"trainer.output_dir={cfg.trainer.output_dir}: {e}")]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], UserError):
        raise payload[0]
    cfg.trainer.output_dir = payload[0]


def check_run_id(cfg: Config, state: dict, path: Path | str) -> None:
    """A UserError when the checkpoint being resumed is not of the run whose files `trainer.output_dir` holds."""
    saved, here = state.get(RUN_ID), runs.read_run_id(cfg.trainer.output_dir)
    if saved and here and saved != here:
        raise UserError(f"trainer.resume={path}: the checkpoint is of run {saved}, but trainer.output_dir="
                        f"{cfg.trainer.output_dir} holds run {here} (its metrics.jsonl and samples); resume into the "
                        "checkpoint's own run folder, or start a new run in another trainer.output_dir")


def run_id(cfg: Config, resumed: str | None) -> str:
    """This run's id: the resumed checkpoint's, else (resuming without one) the folder's, else a new one."""
    if resumed:
        return resumed
    if cfg.trainer.resume != "none":
        return runs.read_run_id(cfg.trainer.output_dir) or runs.new_run_id()
    return runs.new_run_id()
