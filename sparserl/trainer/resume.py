"""What a checkpoint records of the run that saved it, and what a resumed run (`trainer.resume`) does with it.

`trainer_state.pt` holds `settings` (the keys below, as the saving run had them once `auto` was resolved) and
`consecutive_skips` (the non-finite guard's count, actor/actor.py), both registered in the trainer's registry of
saved state by `register` (trainer/saved_state.py). On resume, before any model is built:
  - `FIXED`: the LoRA adapter's rank, alpha, dropout and target modules. Another value would silently change what
    the saved adapters mean (alpha rescales B @ A; other targets drop or add adapters), so a resume that gives one
    is refused with one line naming the key, the saved value and the given one.
  - `RESOLVED`: model.compute_dtype and rollout.dtype. `auto` is settled by a timing probe (utils/precision.py)
    that a resumed run, on another machine or a busier one, may answer otherwise; a resume that leaves them at
    `auto` continues with the saved run's dtype. An explicit value wins, and the log says it differs.
  - `consecutive_skips` carries on, so `trainer.max_skipped_steps` counts skipped steps across a resume.
  - the checkpoint's `run_id` must be the one in `trainer.output_dir/run.json` (trainer/run_dir.py).
A checkpoint saved before this record existed resumes as it did: nothing checked, `auto` probed, the count at 0.

Left out on purpose: refusing other changes (model.path may move; the learning rate, lengths and sampling are
the user's to change between segments of a run).
"""
from __future__ import annotations

from pathlib import Path

from sparserl.config import Config
from sparserl.trainer.run_dir import check_run_id
from sparserl.trainer.saved_state import SavedState, keep
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0

SETTINGS = "settings"
SKIPS = "consecutive_skips"
# key -> why it cannot change on resume
FIXED = {
    "actor.lora.rank": "it is the saved adapters' shape",
    "actor.lora.alpha": "it scales the saved adapters' update B @ A",
    "actor.lora.dropout": "the saved adapters were trained with it",
    "actor.lora.target_modules": "it names the layers that carry the saved adapters",
}
RESOLVED = ("model.compute_dtype", "rollout.dtype")


def _get(cfg: Config, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, (list, tuple)) else value


def _set(cfg: Config, key: str, value) -> None:
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, last, value)


def settings(cfg: Config) -> dict:
    """The `SETTINGS` record of this run (plain strings, numbers and lists)."""
    return {k: _get(cfg, k) for k in (*FIXED, *RESOLVED)}


def record(cfg: Config, consecutive_skips: int) -> dict:
    """What this module adds to a checkpoint's trainer state."""
    return {SETTINGS: settings(cfg), SKIPS: int(consecutive_skips)}


def register(saved: SavedState, cfg: Config, actor) -> None:
    """The record's two pieces in the trainer's registry of saved state (trainer/saved_state.py): `SETTINGS`, saved
    and, on resume, already checked and applied before the processes started (`apply_saved_settings`), and
    `SKIPS`, saved and restored (0 from a checkpoint without it)."""
    saved.register(SETTINGS, lambda: settings(cfg), keep, optional=True)
    saved.register(SKIPS, lambda: int(actor.consecutive_skips), lambda count: set_skips(actor, count), default=0)


def _same(key: str, saved, given) -> bool:
    if key == "actor.lora.target_modules":
        return sorted(map(str, saved)) == sorted(map(str, given))
    if isinstance(saved, float) or isinstance(given, float):
        return float(saved) == float(given)
    return saved == given


def _show(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def check_settings(cfg: Config, state: dict, path: Path | str) -> None:
    """A UserError when this run gives a `FIXED` key another value than the checkpoint's run (nothing to check in a
    checkpoint without the record)."""
    saved = state.get(SETTINGS)
    if not isinstance(saved, dict):
        return
    for key, why in FIXED.items():
        if key not in saved:
            continue
        if key != "actor.lora.rank" and not (saved.get("actor.lora.rank") or 0) > 0:
            continue  # full fine-tuning: the other adapter settings mean nothing
        given = _get(cfg, key)
        if not _same(key, saved[key], given):
            raise UserError(f"trainer.resume={path}: {key}={_show(given)}, but the checkpoint was saved with "
                            f"{key}={_show(saved[key])}; it cannot change on resume ({why}): resume with "
                            f"{key}={_show(saved[key])}, or start a new run")


def restore_precision(cfg: Config, state: dict, path: Path | str) -> None:
    """`auto` in model.compute_dtype / rollout.dtype becomes the checkpoint's resolved dtype; an explicit other
    value is kept and said."""
    saved = state.get(SETTINGS)
    if not isinstance(saved, dict):
        return
    restored, kept = [], []
    for key in RESOLVED:
        was, given = saved.get(key), _get(cfg, key)
        if not was or was == "auto":
            continue
        if given == "auto":
            _set(cfg, key, was)
            restored.append(f"{key}=auto -> {was}")
        elif given != was:
            kept.append(f"{key}={given} (saved with {was})")
    if restored:
        log0(f"precision: {', '.join(restored)}, as the resumed run resolved it ({path})")
    if kept:
        log0(f"precision: resuming with {', '.join(kept)}, as given")


def apply_saved_settings(cfg: Config) -> dict | None:
    """Before the processes build anything: the resumed checkpoint's trainer state (None when not resuming), with
    its fixed settings checked against this run's and its precision put in place of `auto`. Every rank reads the
    same file and reaches the same answer."""
    from sparserl.actor import checkpoint

    path = checkpoint.resolve_resume(cfg.trainer.resume, cfg.trainer.output_dir)
    if path is None:
        return None
    state = checkpoint.read_state(path)
    check_run_id(cfg, state, path)
    check_settings(cfg, state, path)
    restore_precision(cfg, state, path)
    return state


def restore_skips(state: dict, actor) -> None:
    """The non-finite guard's count of skipped steps in a row, as the checkpoint's run left it (0 when absent)."""
    set_skips(actor, state.get(SKIPS, 0))


def set_skips(actor, count) -> None:
    actor.consecutive_skips = int(count)
    if actor.consecutive_skips:
        log0(f"resumed after {actor.consecutive_skips} skipped optimizer step(s) in a row "
             "(trainer.max_skipped_steps counts on from there)")
