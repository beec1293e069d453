"""Build everything a run needs from the config, validating user input before anything is written.

Order matters: config, output folder, env file, data rows, eval sets and model path are checked first
(`preflight.py`: clear one-line errors, no output folder yet); then processes, the tokenizer (whose chat
template may still reject a row), the actor, the engine (built by sparserl/engine_options/build.py from its own options)
and the logger come up. A resumed run first checks the checkpoint's recorded settings against its own and takes its
resolved precision (trainer/resume.py), before `auto` would be probed again.
The eval sets of `trainer.eval_every` are read and checked with the training data (sparserl/eval/).
The KL reference of a LoRA actor is the actor with its adapters off (`build_reference`); a frozen actor built with
`trainable=False` is always the plain base model, LoRA or not.
Left out on purpose: building a second model for evaluation (it runs on the rollout engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from sparserl.actor.actor import Actor
from sparserl.actor.hf import load_tokenizer
from sparserl.config import Config, to_dict, to_yaml
from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.data.prompt_sampler import MixtureSampler, PromptSampler
from sparserl.parallel import DistInfo, ParallelDims, init_distributed
from sparserl.utils.precision import resolve_precision
from sparserl.trainer.loss import zero_advantage_no_grad
from sparserl.trainer.preflight import Inputs, validate_inputs
from sparserl.trainer.resume import apply_saved_settings, record as resume_record, restore_skips
from sparserl.trainer.run_dir import GRPO_ROOT, resolve_output
from sparserl.utils.runs import new_run_id, write_run_file
from sparserl.utils.errors import UserError, one_line
from sparserl.utils.logging import MetricsLogger, log0


def format_prompts(cfg: Config, rows: list[PromptRow], tokenizer) -> list[str]:
    """Each row's prompt text; a row that the chat template rejects is a UserError naming the row."""
    from jinja2 import TemplateError

    source = f"data.train_path={cfg.data.train_path}" if cfg.data.train_path else f"env.path={cfg.env.path} make_prompts()"
    texts = []
    for r in rows:
        try:
            texts.append(format_prompt(r, tokenizer, cfg.data.apply_chat_template, cfg.data.system_prompt))
        except ValueError as e:  # format_prompt's own: already names the row
            raise UserError(f"{source} {e}") from None
        except (TemplateError, TypeError, KeyError) as e:  # raised by the template (its raise_exception, or its expressions)
            raise UserError(f"{source} row {r.index}: the tokenizer's chat template rejects it: {one_line(e)} "
                            "(fix the row's messages to suit this model's template)") from None
    return texts


def filter_long_prompts(cfg: Config, rows: list[PromptRow], prompts: list[str], tokenizer) -> tuple[list[PromptRow], list[str], int]:
    """Drops prompts longer than data.max_prompt_tokens (saying how many); returns rows, texts, longest length."""
    lengths = [len(x) for x in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lengths) if n <= cfg.data.max_prompt_tokens]
    if not keep:
        raise UserError(f"every prompt is longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens} tokens")
    if len(keep) < len(rows):
        log0(f"skipping {len(rows) - len(keep)} of {len(rows)} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return [rows[i] for i in keep], [prompts[i] for i in keep], max(lengths[i] for i in keep)


@dataclass
class TaskEnv:
    """What the rollout runs on: the env (an env module, or OpenReward envs) and its prompt rows."""

    env: Any  # EnvModule | OpenRewardEnvs
    rows: list[PromptRow]
    prompts: list[str]  # prompt texts (OpenReward: labels; the session renders the real prompt)
    max_prompt: int  # longest prompt in tokens (OpenReward: measured on one task per env)
    sizes: list[int] = field(default_factory=list)  # OpenReward: rows per env, in config order
    weights: list[float] = field(default_factory=list)
    server: Any = None  # the ServerProcess rank 0 started for env.openreward.serve

    @property
    def openreward(self) -> bool:
        return bool(self.sizes)

    def max_total_tokens(self, num_slots: int) -> int | None:
        """Tool episodes grow turn by turn: cap a trajectory at what one engine pool can hold (status truncated)."""
        return num_slots if self.openreward else None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def task_env(cfg: Config, inputs: Inputs, tokenizer, rank: int) -> TaskEnv:
    """The data rows through `env.path`, or the OpenReward tasks. For those, rank 0 starts the server of
    `env.openreward.serve` (the others wait for its URL), lists the tasks and measures one prompt per env,
    and every rank receives the same rows."""
    if inputs.openreward is None:
        rows, prompts, max_prompt = filter_long_prompts(cfg, inputs.rows, format_prompts(cfg, inputs.rows, tokenizer), tokenizer)
        return TaskEnv(inputs.env, rows, prompts, max_prompt)
    import atexit

    import torch.distributed as dist

    from sparserl.rollout.openreward.serve import ServerProcess
    from sparserl.rollout.openreward.tasks import env_sizes, probe_prompt_tokens, task_rows

    envs, server, payload = inputs.openreward, None, [None]
    if rank == 0:
        try:
            if cfg.env.openreward.serve:
                out = Path(cfg.trainer.output_dir)
                out.mkdir(parents=True, exist_ok=True)
                server = ServerProcess.start(cfg.env.openreward.serve, log_path=out / "openreward_server.log")
                atexit.register(server.stop)
                envs.base_url = server.url
                log0(f"env.openreward.serve: serving {cfg.env.openreward.serve} at {server.url} "
                     f"(log: {out / 'openreward_server.log'})")
            rows = task_rows(envs)
            payload = [(envs.base_url, envs.variants, rows,
                        probe_prompt_tokens(envs, tokenizer, rows, cfg.env.step_timeout_s or 120.0))]
        except UserError as e:
            payload = [e]
        except (RuntimeError, TimeoutError, OSError) as e:  # the served file's server did not come up
            log = f" (its log: {server.log_path})" if server is not None else f" (its log: {cfg.trainer.output_dir}/openreward_server.log)"
            payload = [UserError(f"env.openreward: {type(e).__name__}: {e}{log if cfg.env.openreward.serve else ''}")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], UserError):
        raise payload[0]
    envs.base_url, envs.variants, rows, max_prompt = payload[0]
    sizes = env_sizes(envs, rows)
    log0("env.openreward: " + ", ".join(f"{s.name} {n} tasks (weight {s.weight:g}, max_turns {s.max_turns})"
                                       for s, n in zip(envs.specs, sizes)) + f"; longest first prompt {max_prompt} tokens")
    return TaskEnv(envs, rows, [r.prompt for r in rows], max_prompt, sizes, [s.weight for s in envs.specs], server)


def build_actor(cfg: Config, model_path: str, mesh, device, trainable: bool = True) -> Actor:
    a, r = cfg.actor, cfg.rollout
    return Actor(model_path, mesh, device, dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype, lr=a.lr,
                 betas=a.betas, weight_decay=a.weight_decay, lr_schedule=a.lr_schedule, warmup_steps=a.warmup_steps,
                 total_steps=cfg.trainer.total_steps * a.updates_per_rollout * a.ppo_epochs, min_lr_ratio=a.min_lr_ratio,
                 max_grad_norm=a.max_grad_norm, max_tokens_per_device=a.max_tokens_per_device,
                 activation_checkpointing=cfg.model.activation_checkpointing, trainable=trainable,
                 entropy_grad=cfg.algo.entropy_coef != 0, logprob_chunk_mb=a.logprob_chunk_mb, share_prompts=a.share_prompts,
                 sampling=(r.temperature, r.top_p, r.top_k), lora=a.lora if trainable else None, seed=cfg.trainer.seed,
                 skip_zero_advantage=trainable and zero_advantage_no_grad(cfg)[0])


def build_reference(cfg: Config, actor: Actor, model_path: str, mesh, device):
    """The KL reference (algo.kl.coef > 0): the initial policy, frozen. With LoRA that is the actor's own base model
    with its adapters off (no second copy of the weights); otherwise a frozen copy of `model.path`."""
    if actor.lora is not None:
        return actor.reference()
    return build_actor(cfg, model_path, mesh, device, trainable=False)


def start_processes(cfg: Config, runs_root: str = GRPO_ROOT) -> tuple[DistInfo, ParallelDims, object]:
    """The process group and the mesh; then the run's folder (`trainer.output_dir` set to it on every rank,
    trainer/run_dir.py) and, when resuming, the checkpoint's settings."""
    info = init_distributed(cfg.parallel.device, cfg.parallel.backend)
    dims = ParallelDims.from_world(info.world_size, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.dp_replicate)
    if cfg.trainer.prompts_per_step % dims.dp:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} must be divisible by the data-parallel size {dims.dp}")
    resolve_output(cfg, info.rank, info.world_size, runs_root)
    apply_saved_settings(cfg)  # trainer.resume: settings that cannot change are checked, `auto` precision restored
    resolve_precision(cfg, info.device)
    hybrid = f" ({dims.dp_replicate} replicas x {dims.dp // dims.dp_replicate} shards)" if dims.dp_replicate > 1 else ""
    log0(f"processes: {info.world_size} on {info.device.type} ({info.backend}); dp {dims.dp}{hybrid} x tp {dims.tp} x "
         f"cp {dims.cp}")
    return info, dims, dims.build_mesh(info.device.type)


def prompt_sampler(cfg: Config, task: TaskEnv, mesh) -> PromptSampler | MixtureSampler:
    """Uniform over the rows; with several OpenReward envs, each batch mixed by their weights."""
    dp = mesh["dp"]
    if len(task.sizes) > 1:
        return MixtureSampler(task.sizes, task.weights, cfg.trainer.prompts_per_step, dp.get_local_rank(), dp.size(),
                              cfg.trainer.seed, cfg.data.shuffle)
    return PromptSampler(len(task.rows), cfg.trainer.prompts_per_step, dp.get_local_rank(), dp.size(), cfg.trainer.seed,
                         cfg.data.shuffle)


def open_output(cfg: Config, rank: int, tokenizer_loaded, run_id: str | None = None) -> MetricsLogger:
    """The run folder's config.yaml and run.json (rank 0), and the metrics logger."""
    out = Path(cfg.trainer.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg))
        write_run_file(out, run_id or new_run_id())
    log0(f"output: {out.resolve()}")
    return MetricsLogger(out, rank, to_dict(cfg), cfg.logger.wandb.mode, cfg.logger.wandb.project, cfg.logger.wandb.name,
                         total_steps=cfg.trainer.total_steps)


__all__ = ["Inputs", "validate_inputs", "TaskEnv", "task_env", "format_prompts", "build_actor", "build_reference", "start_processes",
           "prompt_sampler", "open_output", "load_tokenizer", "filter_long_prompts", "resume_record", "restore_skips"]
