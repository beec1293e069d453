"""Structured configuration: dataclasses registered with Hydra, loaded once at start-up.

`load_config(overrides)` composes `configs/<name>.yaml` over the schema below with command-line overrides
(`key=value`, `+preset=sparse_rl`), checks every overridden key against the schema first (a misspelled key
fails naming the closest valid names), range-checks every value (`config_checks.py`), and returns the typed
`Config`. Nothing past this module sees a DictConfig. Field comments double as the `--help` text (cli.py).
The base configs (`base_configs()`): grpo (training, the CPU demo), eval (`python -m sparserl.eval`) and gpu (the
Sparse-RL paper's GPU settings, `--config-name gpu`); docs/config.md lists every key with its values in each.
Left out on purpose: Hydra's run-directory and logging takeover (`trainer.output_dir` is ours).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparserl.config_checks import check_config
from sparserl.utils.errors import UserError


def _config_dir() -> Path:
    """The base configs: `sparserl/configs` in an installed wheel (setup.py ships the repository's configs/
    there), else the repository's configs/ beside the package (a checkout, or an editable install)."""
    package = Path(__file__).resolve().parent
    shipped = package / "configs"
    return shipped if (shipped / "grpo.yaml").is_file() else package.parent / "configs"


CONFIG_DIR = _config_dir()


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # HF folder, hub id, or the offline alias
    dtype: str = "float32"  # master weights and optimizer state
    compute_dtype: str = "auto"  # forward/backward (FSDP2 mixed precision); auto: bf16 where the hardware runs it fast, else fp32
    activation_checkpointing: bool = True  # recompute each layer in backward: ~4x less update memory, ~same speed on CPU (benchmarks/update_knobs.py)
    allow_pickle_weights: bool = False  # load a local checkpoint whose weights are pickle files (.bin/.pt), not safetensors


@dataclass
class DataConfig:
    train_path: str = ""  # empty: prompts come from the env module's make_prompts()
    prompt_key: str = "prompt"  # the field holding the prompt: a string or a list of {role, content} messages
    answer_key: str = "answer"  # the field holding the reference answer (null where a row has none)
    messages_key: str = "messages"  # where to look when the prompt field is absent or empty
    answer_extract: str = "none"  # none | gsm8k_hash | boxed
    apply_chat_template: str = "auto"  # auto | always | never
    system_prompt: str | None = None  # added to chat prompts that have no system message
    num_generated: int = 4096  # prompts to ask make_prompts() for
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted at start-up)
    shuffle: bool = True  # reshuffle the prompts every epoch (seeded by trainer.seed)


@dataclass
class OpenRewardConfig:
    """OpenReward environments (tool use, multi-turn); when envs is set, they replace env.path and data.train_path."""

    # Org/Name -> {splits, num_samples, nonterminal_reward, reward_reduction, min_reward, max_reward, max_turns, weight,
    # variant} (sparserl/rollout/openreward/spec.py); on the command line: env.openreward.envs={Org/Name: {weight: 2}}
    envs: dict[str, Any] = field(default_factory=dict)
    base_url: str = ""  # the environment server; empty: OpenReward's hosted service (or the server of env.openreward.serve)
    api_key_env: str = "OPENREWARD_API_KEY"  # the environment variable holding the API key (the key is never logged or saved)
    serve: str = ""  # Python file of Environment classes that rank 0 serves on 127.0.0.1 for the run
    tool_parser: str = "hermes"  # hermes | mistral | llama3_json: how tool calls are read from the model's text


@dataclass
class EnvConfig:
    path: str = "envs/arithmetic.py"  # Python file with async step(state, action, extra_info) (relative: also to the project)
    max_turns: int = 1  # turns per episode, unless the env module sets its own max_turns
    step_timeout_s: float = 300.0  # an env step, reset or OpenReward call past this ends its sample with status timeout; 0 = no limit
    max_concurrency: int = 256  # env calls in flight at once per process
    openreward: OpenRewardConfig = field(default_factory=OpenRewardConfig)


@dataclass
class KVConfig:
    algorithm: str = "none"  # none | rkv | snapkv | streaming
    budget: int = 512  # cache entries a sequence keeps after a compression, window included
    divide_method: str = "step_length"  # step_length | newline
    divide_length: int = 128  # step_length: compress every this many decode steps once over budget
    window: int = 8  # the latest tokens: always kept; their queries score the rest
    mix_lambda: float = 0.1  # rkv: score = lambda * importance - (1 - lambda) * redundancy
    kernel: int = 7  # max-pool kernel over the token axis
    sim_threshold: float = 0.5  # rkv: cosine similarity above which two keys count as near-duplicates
    sinks: int = 4  # streaming: attention-sink tokens kept at the start
    share: str = "head"  # head | layer | all
    compress_prompt: bool = False  # may the prompt be compressed below its own length
    variant: str = "paper"  # paper | reference: rkv/snapkv score as their papers say, or exactly as the R-KV / Sparse-RL code


@dataclass
class SGLangConfig:
    """Start-up settings of the SGLang engine (rollout.engine=sglang); see docs/sglang.md."""

    attention_backend: str = "auto"  # auto: torch_native on CPU, SGLang's choice on GPU
    dtype: str = "auto"  # auto: rollout.dtype
    mem_fraction_static: float = 0.5  # device memory for weights + KV pool; the actor shares the device
    max_total_tokens: int = 0  # KV pool tokens; 0: rollout.kv_pool_tokens, else every sequence of a step, densely
    max_running_requests: int = 0  # 0: rollout.max_num_seqs
    chunked_prefill_size: int = 4096  # prompt tokens per prefill chunk; 0: no chunking
    cuda_graph: bool = True  # off on CPU
    memory_saver: bool = True  # sleep() frees GPU memory (torch_memory_saver); off on CPU
    release_weights: bool = True  # sleep() frees the weights too; the trainer reloads them after every update
    weight_bucket_mb: float = 256  # weight sync: tensors per update_weights_from_tensor call
    log_level: str = "error"  # the SGLang engine's own log level (error, warning, info, debug)


@dataclass
class RolloutConfig:
    engine: str = "native"  # native | sglang
    n: int = 8  # samples per prompt (one GRPO group)
    max_new_tokens: int = 256  # response length cap per turn
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # 0 = off
    stop_strings: list[str] = field(default_factory=list)  # end a response at any of these (EOS always ends it)
    dtype: str = "auto"  # the engine's weights and KV cache; auto: as model.compute_dtype's auto
    kv_pool_tokens: int = 0  # slots per layer; 0 = enough for every sequence of a step, densely
    max_num_seqs: int = 256  # sequences decoding at once per engine
    max_batch_tokens: int = 8192  # tokens per engine forward: new prompts are prefilled while they fit
    release_weights: bool = True  # the native engine drops its weight copy while the actor trains (refilled by the sync)
    quantization: str = "none"  # none | int8 (weight-only) | w8a8 (int8 activations too; GPU) | fp8 (GPU): the sampler's linear layers
    quantize_lm_head: bool = False  # quantize the LM head too (embeddings and norms always stay in rollout.dtype)
    decode_cache: str = "off"  # native engine: on | off | auto (= on for CPU engines): contiguous per-sequence K/V copies for decode attention (CPU: ~1.16x faster decode at batch 64, those entries held twice; engines/native/decode_cache.py)
    rescore_seqs: int = 0  # measure-only: per engine and step, re-score this many sequences densely (rollout/kv_mismatch_kl)
    kv: KVConfig = field(default_factory=KVConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class ActorConfig:
    lr: float = 1e-6  # AdamW learning rate after warmup
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0  # optimizer steps of linear warmup
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of actor.lr
    max_grad_norm: float = 1.0  # gradients clipped to this global norm
    max_tokens_per_device: int = 8192  # tokens per packed micro-batch
    logprob_chunk_mb: float = 64  # LM head + log-softmax in row chunks of this many MB of fp32 logits; 0 = all at once
    updates_per_rollout: int = 1  # optimizer steps per rollout (minibatches)
    ppo_epochs: int = 1  # passes over each rollout
    balance_ranks: bool = True  # move sequences between DP ranks before the update so token loads are equal
    fuse_old_logprobs: bool = True  # one update per rollout: logp_old from the update's own forward (no extra pass)
    share_prompts: bool = True  # compute a prompt once per micro-batch for all of its samples (exact; fewer tokens)


@dataclass
class KLConfig:
    coef: float = 0.0  # weight of the KL to the initial policy; 0 = off (no reference model)
    estimator: str = "k3"  # k1 | k2 | k3
    mode: str = "loss"  # loss | reward


@dataclass
class CorrectionSettings:
    enable: bool = False  # correct the sparse/dense mismatch in the loss (docs/correction.md)
    mode: str = "apply"  # apply | measure
    is_cap: float | None = 1.5  # importance weight min(xi, is_cap); null or 0 = no reweighting
    is_batch_normalize: bool = True  # divide the weights by their batch mean
    normalize_over: str = "kept"  # kept | all (the reference recipe: mean over every response token, before rejection)
    apply_to_kl: bool = False  # weight the KL term too
    veto: float | None = 1e-4  # reject a sequence with any token's xi below this
    token_low: float | None = 0.5  # mask tokens with xi below this
    token_high: float | None = 1.5  # mask tokens with xi above this
    geo_low: float | None = None  # reject a sequence whose geometric-mean xi is below this
    geo_high: float | None = None  # reject a sequence whose geometric-mean xi is above this
    rejected_in_baseline: bool = True  # rejected sequences still count in their group's reward baseline


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"  # grpo | drgrpo
    loss_agg: str = "token"  # token | sequence
    policy_loss: str = "ppo"  # ppo | cispo
    clip_low: float = 0.2  # PPO ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # PPO ratio clipped above at 1 + clip_high (> clip_low: clip-higher)
    dual_clip: float | None = None  # PPO dual clip constant for negative advantages; null = off
    entropy_coef: float = 0.0  # entropy bonus weight
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size; data-parallel size = world size / tp
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class TrainerConfig:
    total_steps: int = 20  # training steps (one rollout each)
    prompts_per_step: int = 16  # global, across data-parallel ranks
    output_dir: str = "outputs/grpo"  # config.yaml, metrics.jsonl, checkpoints/, hf/
    save_every: int = 0  # 0 = only at the end
    resume: str = "none"  # none | auto | <checkpoint folder>
    seed: int = 0  # seeds sampling and prompt shuffling
    export_hf: bool = True  # write the final policy to output_dir/hf
    stop_after: int = 0  # stop (as if interrupted) after this many steps; 0 = off
    eval_every: int = 0  # evaluate eval.* on the rollout engine every this many steps, at step 0 and at the end; 0 = off
    log_samples: int = 4  # sequences per step written token by token to samples/step_N.jsonl (and wandb); 0 = off
    keep_last: int = 0  # complete checkpoints kept (older ones removed after each save); 0 = all
    max_skipped_steps: int = 3  # stop after this many optimizer steps in a row skipped for a non-finite loss / grad norm
    # Signals that end the run gracefully: finish the step, save, exit 75 (sparserl/trainer/faults.py).
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class EvalConfig:
    """`python -m sparserl.eval` and evaluation during training (trainer.eval_every); see sparserl/eval/."""

    # Shared eval sets by name (gsm8k, math500, aime24, amc23, minerva, olympiadbench, gaokao2023en, mawps) or
    # {name, path, prompt_key, answer_key, answer_extract, env, suffix} entries (a known name fills the rest).
    datasets: list[Any] = field(default_factory=list)
    data_dir: str = ""  # where the named sets live; empty: the package's own copy (sparserl/data/eval)
    n: int = 1  # samples per prompt
    k: list[int] = field(default_factory=lambda: [1])  # pass@k for each k (1 <= k <= n)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    limit: int = 0  # the first `limit` prompts of each set; 0 = all
    seed: int = 0  # a sample's seed depends on (seed, dataset, prompt index, sample index) only
    output_dir: str = "outputs/eval"  # eval.json, samples.jsonl (training writes under trainer.output_dir/eval/)


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "sparserl"  # wandb project
    name: str | None = None  # wandb run name; null = wandb's choice


@dataclass
class LoggerConfig:
    progress: bool = True  # progress bars on rank 0 where stderr is a terminal (SPARSERL_PROGRESS=0/1 overrides)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def base_configs() -> list[str]:
    """The names `--config-name` accepts: the YAML files directly in the config folder."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name="sparserl_schema", node=Config)
        _registered = True


def _fields(cls) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls)}


def check_key(key: str) -> None:
    """Raise UserError naming the closest valid keys when `key` (dotted) is not in the schema."""
    node = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(node)
        if part not in fields:
            prefix = ".".join(parts[:i])
            valid = [f"{prefix}.{n}" if prefix else n for n in fields]
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5) or difflib.get_close_matches(part, list(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"unknown config key {key!r}{hint} (valid under {prefix or 'the root'}: {', '.join(fields)})")
        ftype = fields[part].default_factory if fields[part].default_factory is not dataclasses.MISSING else None
        node = ftype if (ftype is not None and dataclasses.is_dataclass(ftype)) else None
        if node is None and i < len(parts) - 1:
            if ftype is dict:  # a free-form map: its entries are checked with the loaded config (config_checks)
                path = ".".join(parts[: i + 1])
                raise UserError(f"unknown config key {key!r}: {path} is a map; give its entries as one value, "
                                f"{path}={{name: {{key: value}}}}")
            raise UserError(f"unknown config key {key!r}: {'.'.join(parts[: i + 1])} has no sub-keys")


def _is_map(key: str) -> bool:
    """Whether `key` is a free-form map of the schema (`dict` field), which Hydra's struct mode would refuse to extend."""
    node: Any = Config
    for part in key.split("."):
        f = _fields(node).get(part) if dataclasses.is_dataclass(node) else None
        if f is None or f.default_factory is dataclasses.MISSING:
            return False
        node = f.default_factory
    return node is dict


def _override_key(override: str) -> str | None:
    if "=" not in override:
        raise UserError(f"bad override {override!r}: write key=value")
    key = override.split("=", 1)[0].lstrip("+~")
    if key in ("preset", "hydra") or key.startswith("hydra."):
        return None
    return key


def load_config(overrides: list[str] | None = None, config_name: str = "grpo", config_dir: Path | None = None) -> Config:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    for i, ov in enumerate(overrides):
        key = _override_key(ov)
        if key is not None:
            check_key(key)
            if _is_map(key) and not ov.startswith(("+", "~")):  # a map's entries add to those of the config files
                overrides[i] = "++" + ov
    _register()
    config_dir = Path(config_dir or CONFIG_DIR)
    if not config_dir.exists():
        raise UserError(f"config folder {config_dir} not found (install sparserl with pip install -e .)")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        obj = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(" ".join(str(e).split())) from None
    assert isinstance(obj, Config)
    check_config(obj)
    return obj


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
