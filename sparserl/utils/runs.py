"""Run folders on disk: a folder of runs (`outputs/grpo/`) with one folder per run and a `latest` pointer, what a
run folder holds, and its run id. Plain file operations, no torch: the trainers, the evaluation and the report use
it.

With `trainer.output_dir=auto` (the default) each run gets `<root>/<YYYYmmdd-HHMMSS>` (a `-2`, `-3`, ... suffix when
two start in the same second) and `<root>/latest` points to the newest run that got as far as writing its config:
a symbolic link to the folder's name, or, where the filesystem has none, a file holding that name. A path given to
`python -m sparserl.eval model.path=...` or `python -m sparserl.report` that is such a root (it holds `latest`)
stands for the run `latest` points to (`follow_latest`).

A run folder holds a run once it has logged a step, saved a complete checkpoint or exported `hf/` (`holds_run`);
`run.json` ({"run_id": ..., "started": ...}) names the run whose files they are, and every checkpoint records the
same id, so a resume can tell a checkpoint of this folder's run from one of another run.

Left out on purpose: naming runs after their settings (the folder name is the start time; `config.yaml` inside says
the rest), and pruning old runs.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
RUN_FILE = "run.json"
# What a run writes in its folder: what `trainer.overwrite=true` removes before a new run starts there.
RUN_ENTRIES = ("run.json", "config.yaml", "metrics.jsonl", "checkpoints", "hf", "samples", "eval", "report.html",
               "openreward_server.log")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)


def read_run_id(folder: str | Path) -> str | None:
    """The run id in `folder/run.json`, or None (no file, or one an older version or a person wrote)."""
    try:
        value = json.loads((Path(folder) / RUN_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def write_run_file(folder: str | Path, run_id: str) -> None:
    path = Path(folder) / RUN_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunContents:
    """What a run folder holds, for the messages that name it."""

    steps: int  # the last step logged in metrics.jsonl (0: none)
    checkpoint: int  # the step of the newest complete checkpoint (0: none)
    exported: bool  # hf/ holds a model

    @property
    def any(self) -> bool:
        return bool(self.steps or self.checkpoint or self.exported)

    def describe(self) -> str:
        parts = [f"metrics up to step {self.steps}" if self.steps else "",
                 f"a checkpoint of step {self.checkpoint}" if self.checkpoint else "",
                 "an exported hf/" if self.exported else ""]
        return ", ".join(p for p in parts if p) or "nothing"


def contents(folder: str | Path) -> RunContents:
    folder = Path(folder)
    steps = 0
    try:
        for line in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > 0:
                steps = max(steps, row["step"])
    except OSError:
        pass
    checkpoint = 0
    root = folder / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            name = p.name.removeprefix("step_")
            if p.name.startswith("step_") and name.isdigit() and (p / "COMPLETE").exists():
                checkpoint = max(checkpoint, int(name))
    exported = (folder / "hf" / "config.json").exists() or (folder / "hf" / "adapter_config.json").exists()
    return RunContents(steps, checkpoint, exported)


def holds_run(folder: str | Path) -> bool:
    """Whether `folder` holds a run's results (a logged step, a complete checkpoint, an exported model)."""
    return Path(folder).is_dir() and contents(folder).any


def remove_run(folder: str | Path) -> None:
    """Remove what a run wrote in `folder` (`RUN_ENTRIES`); other files stay."""
    import shutil

    for name in RUN_ENTRIES:
        p = Path(folder) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def latest_run(root: str | Path) -> Path | None:
    """The run folder `root/latest` points to, if it exists."""
    pointer = Path(root) / LATEST
    if pointer.is_symlink():
        target = Path(root) / os.readlink(pointer)
    elif pointer.is_file():
        target = Path(root) / pointer.read_text(encoding="utf-8").strip()
    else:
        return None
    return target if target.is_dir() else None


def follow_latest(path: str | Path) -> Path:
    """`path`, or, for a folder of runs (one with a `latest` pointer), the run `latest` points to."""
    p = Path(path).expanduser()
    run = latest_run(p) if p.is_dir() else None
    return run if run is not None else p


def new_run_folder(root: str | Path) -> Path:
    """Create and return `root/<YYYYmmdd-HHMMSS>` (the first free `-N` suffix when that exists)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        folder = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise RuntimeError(f"{root}: 999 runs started in the second {stamp}")


def point_latest(root: str | Path, folder: str | Path) -> None:
    """Make `root/latest` point to `folder` (a child of `root`), replacing the old pointer in one rename."""
    root, name = Path(root), Path(folder).name
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(name, tmp, target_is_directory=True)
        except OSError:  # no symbolic links here: a file holding the name
            tmp.write_text(name + "\n", encoding="utf-8")
        pointer = root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():  # a real folder named latest is a run: leave it
            return
        os.replace(tmp, pointer)
    finally:
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()
