"""The trainer's input checks on the filesystem, the data, the model and the installed packages: everything a user
can get wrong that the config alone does not show, found before torch is imported or a file written.

`validate_inputs` runs on every rank right after the config loaded; every check of a config VALUE (ranges,
enums, keys that must agree) has run by then, in sparserl/config/, and none is repeated here. What is
left is what needs the machine: SGLang installed with its plugins (rollout.engine=sglang), peft for LoRA actors
(actor.lora.rank > 0, which also refuses adapter dropout with parallel.tp > 1), `trainer.output_dir`
(a folder this process can write, or can create; it is not created here; a named one that holds a run only with
`trainer.resume` or `trainer.overwrite=true`; `auto`: the folder its run folder will be made in), `trainer.resume`,
the env module,
every data row, the eval sets of `trainer.eval_every`, and last the model path (the one check that imports
torch): not a LoRA adapter folder (those are evaluated, `python -m sparserl.eval`), safetensors weights
(pickle files only with `model.allow_pickle_weights=true`) and free disk in `trainer.output_dir` for what the run
holds at its peak (`trainer.keep_last` checkpoints plus the one being written, and the `hf/` export)
(a LoRA checkpoint holds only the adapters and is not measured). Each failure is a `UserError` naming the key or the file and row.

`parallel.tp` x `parallel.cp` must divide the number of processes (torchrun's WORLD_SIZE).
Left out on purpose: checks that need the model (heads divisible by tp, models context parallelism refuses, the
chat template, prompt lengths), which run where the model and tokenizer are loaded.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparserl.config import Config
from sparserl.data.dataset import PromptRow, load_prompts, rows_from_records
from sparserl.eval.datasets import EvalSet, load_eval_sets
from sparserl.engine_options.checks import check_engine
from sparserl.trainer.run_dir import AUTO, GRPO_ROOT
from sparserl.utils import runs
from sparserl.utils.envload import EnvModule, load_env
from sparserl.utils.errors import UserError


@dataclass
class Inputs:
    env: EnvModule | None  # None with OpenReward envs
    rows: list[PromptRow]  # empty with OpenReward envs: their tasks are listed once the processes are up
    model_path: str
    eval_sets: list[EvalSet] = field(default_factory=list)  # trainer.eval_every > 0
    openreward: Any = None  # OpenRewardEnvs (sparserl/rollout/openreward/), when env.openreward.envs is set


def validate_inputs(cfg: Config, runs_root: str = GRPO_ROOT) -> Inputs:
    check_world(cfg)
    check_engine(cfg)
    check_lora(cfg)
    check_output(cfg, runs_root)
    check_resume(cfg.trainer.resume)
    openreward = bool(cfg.env.openreward.envs)
    env = None if openreward else checked_env(cfg.env.path)
    try:
        if openreward:
            rows = []
        elif cfg.data.train_path:
            rows = load_prompts(cfg.data.train_path, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.messages_key,
                                cfg.data.answer_extract)
        elif env.make_prompts is not None:
            records = env.make_prompts(cfg.data.num_generated, cfg.trainer.seed)
            rows = rows_from_records(records, f"env.path={cfg.env.path} make_prompts()", cfg.data.prompt_key,
                                     cfg.data.answer_key, cfg.data.messages_key, cfg.data.answer_extract)
        else:
            raise UserError(f"data.train_path is empty and env.path={cfg.env.path} has no make_prompts(); give a data file")
    except ValueError as e:
        raise UserError(str(e)) from None
    if not rows and not openreward:
        raise UserError(f"data.train_path={cfg.data.train_path}: no rows")
    eval_sets = load_eval_sets(cfg.eval, cfg.env.path) if cfg.trainer.eval_every > 0 else []
    from sparserl.actor.hf import resolve_model_path  # imports torch, so it comes last

    check_not_adapter(cfg.model.path)
    model_path = resolve_model_path(cfg.model.path)
    check_weight_files(model_path, cfg.model.allow_pickle_weights)
    if cfg.critic.enable and cfg.critic.model_path:  # the critic's own start (trainer/critic.py)
        try:
            check_weight_files(resolve_model_path(cfg.critic.model_path), cfg.model.allow_pickle_weights)
        except FileNotFoundError as e:
            raise UserError(str(e).replace("model.path=", "critic.model_path=", 1)) from None
    if cfg.env.reward_model.path:  # a reward-model export (trainer/learned_reward.py)
        from sparserl.trainer.learned_reward import check_export

        check_export(cfg.env.reward_model.path)
    if cfg.actor.lora.rank <= 0:  # a LoRA checkpoint holds the adapters only
        t = cfg.trainer
        check_free_disk(output_folder(cfg, runs_root), model_path,
                        checkpoints=checkpoints_held(t.total_steps, t.save_every, t.keep_last), export_hf=t.export_hf)
    envs = checked_openreward(cfg) if openreward else None
    return Inputs(env=env, rows=rows, model_path=model_path, eval_sets=eval_sets, openreward=envs)


def check_world(cfg: Config, world_size: int | None = None) -> None:
    """parallel.tp x parallel.cp must divide the number of processes (torchrun's WORLD_SIZE; 1 without torchrun).
    `parallel.ParallelDims.from_world` checks it again once the processes are up."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    if world % tp:
        raise UserError(f"parallel.tp={tp} must divide the world size {world}")
    if world % (tp * cp):
        raise UserError(f"parallel.cp={cp} x parallel.tp={tp} must divide the world size {world}")
    rep, dp = cfg.parallel.dp_replicate, world // (tp * cp)
    if dp % rep:
        raise UserError(f"parallel.dp_replicate={rep} must divide the data-parallel size {dp} (world size {world} / "
                        f"(tp {tp} x cp {cp}))")


def check_lora(cfg: Config) -> None:
    """actor.lora.rank > 0 needs peft (adapter dropout with tensor parallelism is refused with the config's checks)."""
    import importlib.util

    lora = cfg.actor.lora
    if lora.rank <= 0:
        return
    if importlib.util.find_spec("peft") is None:
        raise UserError(f'actor.lora.rank={lora.rank} needs the peft library: pip install -e ".[lora]"')


def check_not_adapter(path: str, key: str = "model.path") -> None:
    """A LoRA adapter folder is something to evaluate (python -m sparserl.eval), not a model to train from."""
    from sparserl.actor.lora import is_adapter_folder  # imports torch: called last, with the model path

    p = Path(path).expanduser()
    if is_adapter_folder(p):
        merged = p / "merged"
        hint = f"{key}={merged} (its merged model)" if (merged / "config.json").exists() else \
            "the adapter's base model (base_model_name_or_path in adapter_config.json) with actor.lora.rank > 0"
        raise UserError(f"{key}={path}: a LoRA adapter folder, not a full model to train from; give {hint}, or "
                        f"evaluate it with python -m sparserl.eval {key}={path}")


def checked_openreward(cfg: Config):
    """The run's OpenReward envs; the file of `env.openreward.serve` is imported here to name its classes."""
    import importlib.util

    if importlib.util.find_spec("openreward") is None:
        raise UserError('env.openreward.envs needs the OpenReward SDK: pip install -e ".[envs]"')
    from sparserl.rollout.openreward.serve import environment_classes
    from sparserl.rollout.openreward.tasks import resolve_envs

    served = None
    if cfg.env.openreward.serve:
        try:
            served = [c.__name__ for c in environment_classes(cfg.env.openreward.serve)]
        except (ImportError, TypeError) as e:
            raise UserError(f"env.openreward.serve={cfg.env.openreward.serve}: {type(e).__name__}: {e}") from None
        except SyntaxError as e:
            raise UserError(f"env.openreward.serve={cfg.env.openreward.serve}: not a Python file: {e.msg} (line {e.lineno})") from None
    return resolve_envs(cfg.env.openreward, served)


def check_weight_files(model_path: str, allow_pickle: bool) -> None:
    """A local checkpoint must hold safetensors weights: pickle files can run code when loaded."""
    folder = Path(model_path)
    if allow_pickle or not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
    if pickled:
        raise UserError(f"model.path={model_path}: its weights are pickle files ({', '.join(pickled[:3])}), which can run "
                        "code when loaded; convert them to safetensors, or set model.allow_pickle_weights=true if you "
                        "trust their source")


# A checkpoint holds fp32 weights plus AdamW's two fp32 moments per parameter.
_CHECKPOINT_BYTES_PER_PARAM = 12


def checkpoint_bytes(model_path: str) -> int:
    """About what one checkpoint of this model takes on disk (0 when the model is not a local folder)."""
    import json

    folder = Path(model_path)
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return 0
    try:
        dtype = json.loads((folder / "config.json").read_text()).get("torch_dtype") or "float32"
    except (OSError, ValueError, AttributeError):
        dtype = "float32"
    bytes_per_param = 2 if dtype in ("bfloat16", "float16") else 8 if dtype == "float64" else 4
    return sum(f.stat().st_size for f in files) // bytes_per_param * _CHECKPOINT_BYTES_PER_PARAM


def checkpoints_held(total_steps: int, save_every: int, keep_last: int) -> int:
    """The most checkpoints a run holds on disk at once: `keep_last` complete ones plus the one being written (the
    oldest goes only once the new one is complete), at most as many as it saves (every `save_every` steps and at
    the end); keep_last=0 keeps them all."""
    saves = (total_steps // save_every if save_every else 0) + 1
    return min(saves, keep_last + 1) if keep_last > 0 else saves


def check_free_disk(output_dir: str, model_path: str, key: str = "trainer.output_dir", checkpoints: int = 1,
                    export_hf: bool = False) -> None:
    """Refuse to start when the output folder's disk cannot hold what the run writes at its peak: `checkpoints`
    checkpoints at once (`checkpoints_held`) and, with `export_hf`, the exported policy (the weights' files)."""
    import shutil

    one = checkpoint_bytes(model_path)
    hf = _weight_bytes(model_path) if export_hf else 0
    need = checkpoints * one + hf
    free = shutil.disk_usage(_nearest_existing(Path(output_dir).expanduser().absolute())).free
    if one and free < need:
        what = (f"one checkpoint of this model takes about {one / 2**30:.2f} GiB (weights and optimizer state)"
                if checkpoints == 1 else
                f"the run holds up to {checkpoints} checkpoints at once (trainer.keep_last and the one being written) "
                f"of about {one / 2**30:.2f} GiB each (weights and optimizer state)")
        what += f", and its hf/ export about {hf / 2**30:.2f} GiB" if hf else ""
        raise UserError(f"{key}={output_dir}: {free / 2**30:.2f} GiB free on its disk, but {what}: "
                        f"{need / 2**30:.2f} GiB; free space, lower trainer.keep_last, or choose another {key}")


def _weight_bytes(model_path: str) -> int:
    folder = Path(model_path)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its closest ancestor that exists (where a folder would be created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str, key: str = "trainer.output_dir") -> None:
    """Raise unless `path` is a writable folder or one that can be created; leaves nothing behind."""
    target = Path(path).expanduser().absolute()
    existing = _nearest_existing(target)
    if not existing.is_dir():
        where = "a file is there" if existing == target else f"{existing} is a file"
        raise UserError(f"{key}={path}: {where}, so it cannot be the run's folder; choose another {key}")
    try:  # a real write, since permission bits do not tell (root, read-only mounts, /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".sparserl-write-check-", dir=existing))
    except OSError as e:
        where = "the folder is not writable" if existing == target else f"cannot create a folder in {existing}"
        raise UserError(f"{key}={path}: {where} ({e.strerror}); choose a folder you can write") from None


def output_folder(cfg: Config, runs_root: str) -> str:
    """The folder the run will write to, or with `trainer.output_dir=auto` the one its folder will be made in."""
    return runs_root if cfg.trainer.output_dir == AUTO else cfg.trainer.output_dir


def check_output(cfg: Config, runs_root: str = GRPO_ROOT) -> None:
    """A folder that can be written (trainer/run_dir.py makes it once the processes are up); a named one that holds
    another run only when resuming it or told to start over."""
    t = cfg.trainer
    if t.output_dir == AUTO:
        try:
            check_output_dir(runs_root)
        except UserError as e:  # worded for the folder the runs go in
            raise UserError(f"trainer.output_dir=auto makes a folder in {runs_root}, but " + str(e).split(": ", 1)[1]) from None
        return
    check_output_dir(t.output_dir)
    if t.resume == "none" and not t.overwrite and runs.holds_run(t.output_dir):
        raise UserError(f"trainer.output_dir={t.output_dir} holds a run already ({runs.contents(t.output_dir).describe()}); "
                        "continue it with trainer.resume=auto, start over with trainer.overwrite=true, or leave "
                        f"trainer.output_dir unset for a new folder under {runs_root}/")


def check_resume(resume: str) -> None:
    if resume in ("none", "auto"):
        return
    if not (Path(resume) / "COMPLETE").exists():
        raise UserError(f"trainer.resume={resume}: not a complete sparserl checkpoint folder (no COMPLETE file); "
                        "use none, auto, or a trainer.output_dir/checkpoints/step_N folder")


def checked_env(path: str) -> EnvModule:
    """`load_env`, with a file that is not Python, or not an env, reported in one line."""
    try:
        return load_env(path)
    except SyntaxError as e:
        raise UserError(f"env.path={path}: not a Python env module: {e.msg} (line {e.lineno})") from None
    except (AttributeError, TypeError, ImportError) as e:
        if not str(e).startswith("env.path="):  # raised inside the env's own code: its traceback helps more
            raise
        raise UserError(str(e)) from None
