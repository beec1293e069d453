"""Build everything a run needs from the config, validating user input before anything is written.

Order matters: config, env file, data rows and model path are checked first (clear one-line errors, no
output folder yet); then processes, the actor, the engine and the logger come up.
Left out on purpose: evaluation datasets during training (run `sparserl.eval` style scripts on `hf/`).
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from pathlib import Path

import torch

from sparserl.actor.actor import Actor
from sparserl.actor.hf import load_model, load_tokenizer, resolve_model_path
from sparserl.config import Config, to_dict, to_yaml
from sparserl.data.dataset import PromptRow, format_prompt, load_prompts, rows_from_records
from sparserl.data.sampler import PromptSampler
from sparserl.kv import KVPolicyConfig
from sparserl.parallel import DistInfo, ParallelDims, init_distributed
from sparserl.rollout.engine import build_engine
from sparserl.rollout.types import SamplingParams
from sparserl.utils.envload import EnvModule, load_env
from sparserl.utils.errors import UserError
from sparserl.utils.logging import MetricsLogger, log0


@dataclass
class Inputs:
    env: EnvModule
    rows: list[PromptRow]
    model_path: str


def validate_inputs(cfg: Config) -> Inputs:
    if cfg.rollout.engine == "sglang":
        from sparserl.rollout.sglang import check_config  # imports no sglang: it says when sglang is missing

        check_config(cfg)
    env = load_env(cfg.env.path)
    try:
        if cfg.data.train_path:
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
    if not rows:
        raise UserError(f"data.train_path={cfg.data.train_path}: no rows")
    return Inputs(env=env, rows=rows, model_path=resolve_model_path(cfg.model.path))


def format_prompts(cfg: Config, rows: list[PromptRow], tokenizer) -> list[str]:
    return [format_prompt(r, tokenizer, cfg.data.apply_chat_template, cfg.data.system_prompt) for r in rows]


def filter_long_prompts(cfg: Config, rows: list[PromptRow], prompts: list[str], tokenizer) -> tuple[list[PromptRow], list[str], int]:
    """Drops prompts longer than data.max_prompt_tokens (saying how many); returns rows, texts, longest length."""
    lengths = [len(x) for x in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lengths) if n <= cfg.data.max_prompt_tokens]
    if not keep:
        raise UserError(f"every prompt is longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens} tokens")
    if len(keep) < len(rows):
        log0(f"skipping {len(rows) - len(keep)} of {len(rows)} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return [rows[i] for i in keep], [prompts[i] for i in keep], max(lengths[i] for i in keep)


def kv_policy(cfg: Config) -> KVPolicyConfig:
    try:  # rollout.kv mirrors KVPolicyConfig field for field
        return KVPolicyConfig(**dataclasses.asdict(cfg.rollout.kv))
    except ValueError as e:
        raise UserError(f"rollout.kv: {e}") from None


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    try:
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_strings=tuple(r.stop_strings), n=r.n)
    except (ValueError, TypeError) as e:
        raise UserError(f"rollout: {e}") from None


def pool_slots(cfg: Config, max_prompt_len: int, prompts_per_rank: int) -> int:
    if cfg.rollout.kv_pool_tokens > 0:
        return cfg.rollout.kv_pool_tokens
    # Enough for every sequence of a step at its dense worst case: no request ever waits on memory.
    return max(1, prompts_per_rank * cfg.rollout.n) * (max_prompt_len + cfg.rollout.max_new_tokens)


def build_rollout_engine(cfg: Config, model_path: str, tokenizer, device: torch.device, num_slots: int, seed: int):
    if cfg.rollout.engine == "native":
        model = load_model(model_path, cfg.rollout.dtype, device)
        return build_engine("native", model=model, tokenizer=tokenizer, num_slots=num_slots,
                            max_num_seqs=cfg.rollout.max_num_seqs, max_batch_tokens=cfg.rollout.max_batch_tokens,
                            seed=seed, kv=kv_policy(cfg), release_weights=cfg.rollout.release_weights)
    if cfg.rollout.engine == "sglang":
        return build_engine("sglang", cfg=cfg, model_path=model_path, tokenizer=tokenizer, device=device,
                            num_slots=num_slots, seed=seed)
    return build_engine(cfg.rollout.engine, cfg=cfg, model_path=model_path, tokenizer=tokenizer)


def build_actor(cfg: Config, model_path: str, mesh, device, trainable: bool = True) -> Actor:
    a, r = cfg.actor, cfg.rollout
    return Actor(model_path, mesh, device, dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype, lr=a.lr,
                 betas=a.betas, weight_decay=a.weight_decay, lr_schedule=a.lr_schedule, warmup_steps=a.warmup_steps,
                 total_steps=cfg.trainer.total_steps * a.updates_per_rollout * a.ppo_epochs, min_lr_ratio=a.min_lr_ratio,
                 max_grad_norm=a.max_grad_norm, max_tokens_per_device=a.max_tokens_per_device,
                 activation_checkpointing=cfg.model.activation_checkpointing, trainable=trainable,
                 entropy_grad=cfg.algo.entropy_coef != 0, logprob_chunk_mb=a.logprob_chunk_mb,
                 sampling=(r.temperature, r.top_p, r.top_k))


def start_processes(cfg: Config) -> tuple[DistInfo, ParallelDims, object]:
    info = init_distributed(cfg.parallel.device, cfg.parallel.backend)
    dims = ParallelDims.from_world(info.world_size, cfg.parallel.tp)
    if cfg.trainer.prompts_per_step % dims.dp:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} must be divisible by the data-parallel size {dims.dp}")
    return info, dims, dims.build_mesh(info.device.type)


def prompt_sampler(cfg: Config, num_rows: int, mesh) -> PromptSampler:
    dp = mesh["dp"]
    return PromptSampler(num_rows, cfg.trainer.prompts_per_step, dp.get_local_rank(), dp.size(), cfg.trainer.seed, cfg.data.shuffle)


def open_output(cfg: Config, rank: int, tokenizer_loaded) -> MetricsLogger:
    out = Path(cfg.trainer.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg))
    log0(f"output: {out.resolve()}")
    return MetricsLogger(out, rank, to_dict(cfg), cfg.logger.wandb.mode, cfg.logger.wandb.project, cfg.logger.wandb.name,
                         total_steps=cfg.trainer.total_steps)


__all__ = ["validate_inputs", "format_prompts", "sampling_params", "pool_slots", "build_rollout_engine", "build_actor",
           "start_processes", "prompt_sampler", "open_output", "load_tokenizer", "filter_long_prompts"]
