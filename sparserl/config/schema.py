"""The run's configuration schema: dataclasses registered with Hydra, loaded once at start-up.

The dataclasses below are the schema AND every default of a training run: configs/grpo.yaml sets no value, and
the other base configs (configs/eval.yaml, configs/gpu.yaml) and the presets (configs/preset/) only override.
Each field is declared with `opt(default, help, choices=..., rule=...)` (sparserl/config/fields.py): its `--help`
text, its valid enum names or its rule live in the field's metadata, which `--help` (sparserl/cli.py),
docs/config.md (scripts/gen_reference.py) and the checks read. Enums are plain `str` fields with declared
`choices`, not `typing.Literal`: OmegaConf 2.3 refuses Literal annotations in structured configs. The groups
`rollout.kv` and `algo.correction` are the library's own `KVPolicyConfig` (sparserl/kv/policy.py) and
`CorrectionConfig` (sparserl/algo/correction_config.py), which check their values when built.

Loading (composing the YAML files with the command line, checking keys and values) is sparserl/config/load.py.
The base configs (`base_configs()`): grpo (training, the CPU demo), eval (`python -m sparserl.eval`)
and gpu (the Sparse-RL paper's GPU settings, `--config-name gpu`); docs/config.md lists every key with its
values in each. This module imports no torch.
Left out on purpose: Hydra's run-directory and logging takeover (`trainer.output_dir` is ours).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sparserl.algo.correction_config import CorrectionConfig
from sparserl.config.critic import CriticConfig
from sparserl.config.partial import PartialConfig
from sparserl.config.reward_model import RewardModelConfig
from sparserl.config.fields import (COUNT, NON_EMPTY, NON_NEG, PROB, ConfigError, Rule, above, each, opt, or_null,
                                    show, within)
from sparserl.utils.kv_memory import KV_DTYPES, SYNTAX, is_kv_memory, parse_kv_memory
from sparserl.kv.policy import KVPolicyConfig

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64")  # actor/hf.py DTYPES
# `opt(..., **DTYPES)`: a dtype key's valid names and how --help words them.
DTYPES = {"choices": DTYPE_NAMES, "choices_desc": "float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)"}
AUTO_DTYPES = {"choices": ("auto", *DTYPE_NAMES),
               "choices_desc": "auto, float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)"}


def _config_dir() -> Path:
    """The base configs: `sparserl/configs` in an installed wheel (setup.py ships the repository's configs/
    there), else the repository's configs/ beside the package (a checkout, or an editable install)."""
    package = Path(__file__).resolve().parents[1]
    shipped = package / "configs"
    return shipped if (shipped / "grpo.yaml").is_file() else package.parent / "configs"


CONFIG_DIR = _config_dir()


@dataclass
class ModelConfig:
    path: str = opt("smollm2-135m-instruct", "HF folder, hub id, or the offline alias")
    dtype: str = opt("float32", "master weights and optimizer state", **DTYPES)
    compute_dtype: str = opt("auto", "forward/backward (FSDP2 mixed precision); auto: bf16 where the hardware runs "
                                     "it fast, else fp32", **AUTO_DTYPES)
    activation_checkpointing: bool = opt(True, "recompute each layer in backward: much less update memory for "
                                               "one more forward (docs/performance.md, benchmarks/update_knobs.py)")
    allow_pickle_weights: bool = opt(False, "load a local checkpoint whose weights are pickle files (.bin/.pt), "
                                            "not safetensors")


@dataclass
class DataConfig:
    train_path: str = opt("", "empty: prompts come from the env module's make_prompts()")
    prompt_key: str = opt("prompt", "the field holding the prompt: a string or a list of {role, content} messages",
                          rule=NON_EMPTY)
    answer_key: str = opt("answer", "the field holding the reference answer (null where a row has none)",
                          rule=NON_EMPTY)
    messages_key: str = opt("messages", "where to look when the prompt field is absent or empty", rule=NON_EMPTY)
    answer_extract: str = opt("none", "none | gsm8k_hash | boxed", choices=("none", "gsm8k_hash", "boxed"))
    apply_chat_template: str = opt("auto", "auto | always | never", choices=("auto", "always", "never"))
    system_prompt: str | None = opt(None, "added to chat prompts that have no system message")
    num_generated: int = opt(4096, "prompts to ask make_prompts() for", rule=COUNT)
    max_prompt_tokens: int = opt(1024, "longer prompts are skipped (counted at start-up)", rule=COUNT)
    shuffle: bool = opt(True, "reshuffle the prompts every epoch (seeded by trainer.seed)")


@dataclass
class OpenRewardConfig:
    """OpenReward environments (tool use, multi-turn); when envs is set, they replace env.path and data.train_path."""

    envs: dict[str, Any] = opt({}, "Org/Name -> {splits, num_samples, nonterminal_reward, reward_reduction, "
                                   "min_reward, max_reward, max_turns, weight, variant} "
                                   "(sparserl/rollout/openreward/spec.py); on the command line: "
                                   "'env.openreward.envs={Org/Name: {weight: 2}}'")
    base_url: str = opt("", "the environment server; empty: OpenReward's hosted service (or the server of "
                            "env.openreward.serve)")
    api_key_env: str = opt("OPENREWARD_API_KEY", "the environment variable holding the API key (the key is never "
                                                 "logged or saved)", rule=NON_EMPTY)
    serve: str = opt("", "Python file of Environment classes that rank 0 serves on 127.0.0.1 for the run")
    tool_parser: str = opt("hermes", "hermes | mistral | llama3_json: how tool calls are read from the model's text",
                           choices=("hermes", "mistral", "llama3_json"))


@dataclass
class EnvConfig:
    path: str = opt("envs/arithmetic.py", "Python file with async step(state, action, extra_info) (relative: also "
                                          "to the project)")
    max_turns: int = opt(1, "turns per episode, unless the env module sets its own max_turns", rule=COUNT)
    step_timeout_s: float = opt(300.0, "an env step, reset or OpenReward call past this ends its sample with "
                                       "status timeout; 0 = no limit", rule=NON_NEG)
    max_concurrency: int = opt(256, "env calls in flight at once per process", rule=COUNT)
    openreward: OpenRewardConfig = opt(OpenRewardConfig, "OpenReward environments (tool use, multi-turn); when envs "
                                                         "is set, they replace env.path and data.train_path.")
    reward_model: RewardModelConfig = opt(RewardModelConfig, "a learned reward: a reward model's score replaces or "
                                                             "is added to the env's reward (docs/rm.md)")


@dataclass
class SGLangConfig:
    """Start-up settings of the SGLang engine (rollout.engine=sglang) that the native engine has no counterpart
    for; see docs/sglang.md. The settings both engines share are rollout.dtype, rollout.release_weights,
    rollout.kv_pool_tokens and rollout.max_num_seqs."""

    attention_backend: str = opt("auto", "auto: torch_native on CPU, SGLang's choice on GPU")
    mem_fraction_static: float = opt(0.5, "device memory for weights + KV pool; the actor shares the device",
                                     rule=within("(0, 1)"))
    chunked_prefill_size: int = opt(4096, "prompt tokens per prefill chunk; 0: no chunking", rule=NON_NEG)
    memory_saver: bool = opt(True, "sleep() frees GPU memory (torch_memory_saver); off on CPU")
    weight_bucket_mb: float = opt(256.0, "weight sync: tensors per update_weights_from_tensor call", rule=above(0))
    log_level: str = opt("error", "the SGLang engine's own log level (error, warning, info, debug)")


def _decode_cache_or_graphs(r: Any, p: str) -> None:
    if r.decode_cache == "on" and r.cuda_graphs == "on":
        raise ConfigError(f"{p}.decode_cache=on with {p}.cuda_graphs=on: the captured decode step attends over the "
                          f"pool through its own static buffers and keeps no decode cache; set one of them to off or "
                          f"auto")


def _one_pool_size(r: Any, p: str) -> None:
    if parse_kv_memory(r.kv_memory).is_set and r.kv_pool_tokens > 0:
        raise ConfigError(f"{p}.kv_memory={r.kv_memory} and {p}.kv_pool_tokens={r.kv_pool_tokens} both size the KV pool; "
                          f"give one ({p}.kv_memory in bytes, or {p}.kv_pool_tokens in entries)")


def _kv_dtype_engine(r: Any, p: str) -> None:
    if r.engine != "sglang":
        return
    if r.kv_dtype == "int8":
        raise ConfigError(f"{p}.kv_dtype=int8 with {p}.engine=sglang: SGLang has no int8 KV cache (its kv_cache_dtype "
                          f"takes auto, bf16, fp8_e4m3, fp8_e5m2); use {p}.engine=native, or {p}.kv_dtype=fp8 on CUDA")
    if r.kv_dtype == "fp8" and r.kv.algorithm != "none":
        raise ConfigError(f"{p}.kv_dtype=fp8 with {p}.engine=sglang and {p}.kv.algorithm={r.kv.algorithm}: the "
                          f"sparserl_kv backend scores and moves SGLang's pool in rollout.dtype; fp8 KV with SGLang is "
                          f"dense only (use {p}.engine=native for compression over a quantized pool)")


def _admission_engine(r: Any, p: str) -> None:
    if r.admission == "reserve" and r.engine != "native":
        raise ConfigError(f"{p}.admission=reserve with {p}.engine={r.engine}: worst-case reservation is the native "
                          f"engine's; SGLang's scheduler admits optimistically (use {p}.admission=optimistic)")


@dataclass
class RolloutConfig:
    RELATIONS: ClassVar[tuple] = (_decode_cache_or_graphs, _one_pool_size, _admission_engine, _kv_dtype_engine)

    engine: str = opt("native", "native | sglang", choices=("native", "sglang"))
    n: int = opt(8, "samples per prompt (one GRPO group)", rule=COUNT)
    max_new_tokens: int = opt(48, "response length cap per turn", rule=COUNT)
    temperature: float = opt(1.0, "0 = greedy", rule=NON_NEG)
    top_p: float = opt(1.0, "nucleus sampling; 1 = off", rule=within("(0, 1]"))
    top_k: int = opt(0, "0 = off", rule=NON_NEG)
    stop_strings: list[str] = opt([], "end a response at any of these (EOS always ends it)", rule=each(NON_EMPTY))
    dtype: str = opt("auto", "the engine's weights and KV cache, for both engines; auto: as model.compute_dtype's "
                             "auto", **AUTO_DTYPES)
    kv_memory: str = opt("0", "the KV pool of each engine in bytes, for both engines (SGLang: its max_total_tokens): "
                              "a size (64MB, 1.5GB; MB = 2**20 bytes), megabytes as a bare number (64), a fraction "
                              "in (0, 1) of the device memory free when the engine is sized (0.3; CUDA), or 0 "
                              "(unset); entries = bytes / (2 x layers x KV heads x (head dim x element bytes + scale "
                              "bytes)), of rollout.kv_dtype; give it or rollout.kv_pool_tokens, not both "
                              "(sparserl/utils/kv_memory.py)",
                         rule=Rule(is_kv_memory, SYNTAX))
    kv_dtype: str = opt("auto", "what the KV pool stores: auto (= rollout.dtype) | bf16 | fp16 | fp32 | int8 | fp8; "
                                "int8: 1 byte per element + a float32 scale per token and KV head; fp8: e4m3, the "
                                "same scales (SGLang: its fp8_e4m3, CUDA, dense only); rollout.kv_memory then holds "
                                "that many more entries. Attention and the compaction read it dequantized; native "
                                "decode steps then run eagerly (no captured graphs); SGLang has no int8 "
                                "(sparserl/kv/kv_dtype.py, docs/kv_compression.md)", choices=KV_DTYPES)
    kv_pool_tokens: int = opt(0, "KV slots per layer, for both engines (SGLang's max_total_tokens); 0 = "
                                 "rollout.kv_memory, or enough for every sequence of a step, densely", rule=NON_NEG)
    admission: str = opt("optimistic", "native engine: optimistic | reserve: admit a sequence while its current KV "
                                       "need fits (retracting the youngest, re-prefilled later, when the pool runs "
                                       "out) or only while its worst case does (nothing retracted); SGLang "
                                       "admits optimistically (engines/native/scheduler.py, docs/decisions.md)",
                         choices=("optimistic", "reserve"))
    max_num_seqs: int = opt(256, "sequences decoding at once per engine, for both engines (SGLang's "
                                 "max_running_requests)", rule=COUNT)
    max_batch_tokens: int = opt(8192, "tokens per engine forward: new prompts are prefilled while they fit", rule=COUNT)
    release_weights: bool = opt(True, "the engine drops its weight copy while the actor trains (refilled by the "
                                      "sync), for both engines (SGLang: sleep() frees the weights too)")
    quantization: str = opt("none", "none | int8 (weight-only) | w8a8 (int8 activations too; GPU) | fp8 (GPU): the "
                                    "sampler's linear layers", choices=("none", "int8", "w8a8", "fp8"))
    quantize_lm_head: bool = opt(False, "quantize the LM head too (embeddings and norms always stay in "
                                        "rollout.dtype)")
    decode_cache: str = opt("auto", "native engine: on | off | auto (= on for CPU engines): contiguous per-sequence "
                                    "K/V copies for decode attention, no per-layer gather (faster decode on CPU, "
                                    "those entries held twice; engines/native/decode_cache.py, docs/performance.md)",
                            choices=("auto", "on", "off"))
    prepack: str = opt("auto", "native engine: auto | on | off | onednn | mkl (auto = on for CPU engines in float32, "
                               "unquantized): linear weights also kept packed for the decode batch's GEMMs, in "
                               "MKL's layout on Intel CPUs and oneDNN's elsewhere (onednn / mkl: that one); faster "
                               "decode GEMMs, the linear weights held twice; engines/native/prepack.py, "
                               "benchmarks/prepack.py",
                       choices=("auto", "on", "off", "onednn", "mkl"))
    cuda_graphs: str = opt("auto", "both engines: on | off | auto (= on for CUDA engines): decode-only steps replay a "
                                   "captured CUDA graph over batch-size buckets (native: static buffers, eager "
                                   "replay on CPU with on; SGLang: its own graphs, kept with KV compression)",
                           choices=("auto", "on", "off"))
    rescore_seqs: int = opt(0, "measure-only: per engine and step, re-score this many sequences densely "
                               "(rollout/kv_mismatch_kl)", rule=NON_NEG)
    kv: KVPolicyConfig = opt(KVPolicyConfig)
    partial: PartialConfig = opt(PartialConfig, "Partial rollouts: a step stops generating before its longest "
                                 "samples end and carries them on (docs/training.md); native engine, single-turn envs")
    sglang: SGLangConfig = opt(SGLangConfig, "Start-up settings of the SGLang engine (rollout.engine=sglang); see "
                                             "docs/sglang.md.")


@dataclass
class LoRAConfig:
    """Low-rank adapters (the peft library): only the adapters train; the engines receive base + adapter merged."""

    rank: int = opt(0, "adapter rank; 0 = full fine-tuning (no adapters)", rule=NON_NEG)
    alpha: float = opt(32.0, "adapter scale numerator: the update is (alpha / rank) * B @ A", rule=above(0))
    dropout: float = opt(0.0, "dropout on the adapters' input in the update (0 keeps the actor's log-probs equal to "
                              "the engine's)", rule=within("[0, 1)"))
    target_modules: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    "module names that get adapters (peft's target_modules; all-linear: every linear "
                                    "layer but the LM head)", rule=each(NON_EMPTY, min_len=1))
    export_merged: bool = opt(False, "the final HF export also writes the merged model (base + adapter) beside the "
                                     "adapter")


@dataclass
class ActorConfig:
    lr: float = opt(5e-6, "AdamW learning rate after warmup", rule=NON_NEG)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", rule=NON_NEG)
    betas: list[float] = opt([0.9, 0.999], "AdamW (beta1, beta2)", rule=each(within("[0, 1)"), length=2))
    lr_schedule: str = opt("constant", "constant | cosine", choices=("constant", "cosine"))
    warmup_steps: int = opt(0, "optimizer steps of linear warmup", rule=NON_NEG)
    min_lr_ratio: float = opt(0.0, "cosine: the final learning rate as a fraction of actor.lr", rule=PROB)
    max_grad_norm: float = opt(1.0, "gradients clipped to this global norm", rule=above(0))
    max_tokens_per_device: int = opt(4096, "tokens per packed micro-batch on each device (with parallel.cp=C a "
                                           "micro-batch holds C times as many, split over the cp ranks)", rule=COUNT)
    logprob_chunk_mb: float | None = opt(None, "LM head + log-softmax in row chunks of this many MB of fp32 logits; "
                                               "null = by device (1024 on CUDA, 64 elsewhere); 0 = all at once",
                                         rule=Rule(lambda v: v is None or NON_NEG.test(v),
                                                   f"{NON_NEG.desc}, or null (by device)"))
    updates_per_rollout: int = opt(1, "optimizer steps per rollout (minibatches)", rule=COUNT)
    ppo_epochs: int = opt(1, "passes over each rollout", rule=COUNT)
    balance_ranks: bool = opt(True, "move sequences between DP ranks before the update so token loads are equal")
    fuse_old_logprobs: bool = opt(True, "one update per rollout: logp_old from the update's own forward (no extra "
                                        "pass)")
    share_prompts: bool = opt(True, "compute a prompt once per micro-batch for all of its samples (exact; fewer "
                                    "tokens)")
    skip_zero_advantage: bool = opt(True, "sequences whose group's rewards all tie (advantage 0) run their forward "
                                          "without autograd and skip backward, where the loss is 0 for them (no KL "
                                          "or entropy term; exact)")
    lora: LoRAConfig = opt(LoRAConfig, "Low-rank adapters (the peft library): only the adapters train; the engines "
                                       "receive base + adapter merged.")


@dataclass
class KLConfig:
    coef: float = opt(0.0, "weight of the KL to the initial policy; 0 = off (no reference model)", rule=NON_NEG)
    estimator: str = opt("k3", "k1 | k2 | k3", choices=("k1", "k2", "k3", "kl", "mse", "low_var_kl"))
    mode: str = opt("loss", "loss | reward", choices=("loss", "reward"))


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: groups whose samples all got the same reward carry no GRPO signal; they are dropped and
    more prompts are rolled out, in rounds, until the step has trainer.prompts_per_step informative groups."""

    enable: bool = opt(False, "drop groups with zero reward variance (and groups the correction rejected whole) and "
                              "roll out more prompts until the step is full")
    max_rounds: int = opt(4, "rollout rounds per step at most, the first included; after the last the step trains on "
                             "the informative groups it has", rule=COUNT)


@dataclass
class OverlongConfig:
    """Responses cut by the length cap (rollout.max_new_tokens): left out of the loss, or punished softly (DAPO)."""

    mask: bool = opt(False, "truncated responses leave the loss (they still count in their group's baseline)")
    penalty: float = opt(0.0, "DAPO soft overlong punishment: reward minus penalty x a linear ramp from 0 to 1 over "
                              "the last `buffer` tokens of rollout.max_new_tokens; 0 = off", rule=NON_NEG)
    buffer: int = opt(16, "tokens at the end of rollout.max_new_tokens over which the penalty ramps up", rule=COUNT)


@dataclass
class AlgoConfig:
    adv_estimator: str = opt("grpo", "grpo | drgrpo | rloo (leave-one-out group baseline) | reinforce_pp (REINFORCE++: "
                                     "per-token returns with the KL penalty of algo.kl.mode=reward, whitened over the "
                                     "batch) | reinforce_pp_baseline (the group mean subtracted first) | gae (GAE "
                                     "with the critic's values, critic.enable=true; +preset=ppo)",
                             choices=("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"))
    gamma: float = opt(1.0, "gae: discount per model token", rule=PROB)
    lam: float = opt(1.0, "gae: the GAE lambda (1: the return minus the value; 0: one-step TD)", rule=PROB)
    loss_agg: str = opt("token", "token | sequence", choices=("token", "sequence"))
    policy_loss: str = opt("ppo", "ppo | cispo | gspo (one clipped ratio per sequence, the geometric mean of its "
                                  "tokens'; +preset=gspo) | gspo_token (GSPO's ratio with per-token advantages)",
                           choices=("ppo", "cispo", "gspo", "gspo_token"))
    clip_low: float = opt(0.2, "ratio clipped below at 1 - clip_low (GSPO's sequence ratio too: 3e-4 in +preset=gspo)",
                          rule=within("[0, 1)"))
    clip_high: float = opt(0.2, "ratio clipped above at 1 + clip_high (> clip_low: clip-higher; 4e-4 in +preset=gspo)",
                           rule=NON_NEG)
    dual_clip: float | None = opt(None, "PPO dual clip constant for negative advantages; null = off",
                                  rule=or_null(above(1)))
    entropy_coef: float = opt(0.0, "entropy bonus weight", rule=NON_NEG)
    kl: KLConfig = opt(KLConfig)
    correction: CorrectionConfig = opt(CorrectionConfig(enable=False))  # off unless a preset or override turns it on
    dynamic_sampling: DynamicSamplingConfig = opt(DynamicSamplingConfig, "DAPO dynamic sampling: groups without reward "
                                                  "variance are dropped and more prompts rolled out until the step is full.")
    overlong: OverlongConfig = opt(OverlongConfig, "Responses cut by rollout.max_new_tokens: left out of the loss, or "
                                                   "punished softly (DAPO).")


@dataclass
class ParallelConfig:
    tp: int = opt(1, "tensor-parallel size; data-parallel size = world size / (tp x cp)", rule=COUNT)
    cp: int = opt(1, "context-parallel size: ranks that split each packed micro-batch along the sequence "
                     "(ring attention, docs/context_parallel.md)", rule=COUNT)
    dp_replicate: int = opt(1, "hybrid sharding: the data-parallel ranks form this many replicas of the model, each "
                               "sharded (FSDP2) over dp / dp_replicate ranks; 1: one shard group over all dp ranks",
                            rule=COUNT)
    backend: str = opt("auto", "auto | gloo | nccl", choices=("auto", "gloo", "nccl"))
    device: str = opt("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))


def _overwrite_starts_over(t: Any, p: str) -> None:
    if t.overwrite and t.resume != "none":
        raise ConfigError(f"{p}.overwrite=true starts the run over, but {p}.resume={t.resume} continues one; "
                          "set one of them")


@dataclass
class TrainerConfig:
    RELATIONS: ClassVar[tuple] = (_overwrite_starts_over,)

    total_steps: int = opt(15, "training steps (one rollout each); the default is the first run's (about 10 min "
                               "on 2 CPU cores); 30 steps of 16 prompts draw the longer curve", rule=COUNT)
    prompts_per_step: int = opt(8, "global, across data-parallel ranks", rule=COUNT)
    output_dir: str = opt("auto", "the run's folder: config.yaml, metrics.jsonl, checkpoints/, hf/; auto = a new "
                                  "folder per run, outputs/grpo/<date-time> (SFT: outputs/sft/...), with "
                                  "outputs/grpo/latest pointing to the newest; a named folder that holds a run is "
                                  "refused unless resuming or trainer.overwrite=true", rule=NON_EMPTY)
    overwrite: bool = opt(False, "start over in a trainer.output_dir that holds another run, removing its files "
                                 "(metrics, samples, checkpoints, hf/) first")
    save_every: int = opt(10, "checkpoint every this many steps (and at the end, and when preempted): a crash "
                              "loses at most this many; 0 = only at the end", rule=NON_NEG)
    resume: str = opt("none", "none | auto (the newest checkpoint of trainer.output_dir; with output_dir=auto, of "
                              "the newest run) | <checkpoint folder>",
                      rule=Rule(lambda v: isinstance(v, str) and v.strip() != "", "none, auto or a checkpoint folder",
                           ("none", "auto")))
    seed: int = opt(0, "seeds sampling and prompt shuffling", rule=NON_NEG)
    export_hf: bool = opt(True, "write the final policy to output_dir/hf")
    stop_after: int = opt(0, "stop (as if interrupted) after this many steps; 0 = off", rule=NON_NEG)
    eval_every: int = opt(0, "evaluate eval.* on the rollout engine every this many steps, at step 0 and at the "
                             "end; 0 = off", rule=NON_NEG)
    log_samples: int = opt(4, "sequences per step written token by token to samples/step_N.jsonl (and wandb); 0 = "
                              "off", rule=within("[0, 64]"))
    keep_last: int = opt(3, "complete checkpoints kept (older ones removed after each save, the newest "
                            "included); 0 = all", rule=NON_NEG)
    max_skipped_steps: int = opt(3, "stop after this many optimizer steps in a row skipped for a non-finite loss / "
                                    "grad norm", rule=COUNT)
    preempt_signals: list[str] = opt(["SIGTERM", "SIGUSR1"], "Signals that end the run gracefully: finish the "
                                                             "step, save, exit 75 (sparserl/trainer/faults.py).",
                                     choices=("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"))


def _k_within_n(ev: Any, p: str) -> None:
    if any(k > ev.n for k in ev.k):
        raise ConfigError(f"{p}.k={show(list(ev.k))}: every k must be in [1, {p}.n={ev.n}] (pass@k needs n >= k samples)")


def _greedy_is_one_sample(ev: Any, p: str) -> None:
    if ev.n > 1 and ev.temperature == 0:
        raise ConfigError(f"{p}.n={ev.n} at {p}.temperature=0: greedy decoding draws the same response {ev.n} times, "
                          f"so pass@k would be pass@1; set {p}.temperature > 0 (e.g. {p}.temperature=0.6 "
                          f"{p}.top_p=0.95) for pass@k, or {p}.n=1")


@dataclass
class EvalConfig:
    """`python -m sparserl.eval` and evaluation during training (trainer.eval_every); see sparserl/eval/."""

    RELATIONS: ClassVar[tuple] = (_k_within_n, _greedy_is_one_sample)

    datasets: list[Any] = opt([], "Shared eval sets by name (gsm8k, math500, aime24, amc23, minerva, "
                                  "olympiadbench, gaokao2023en, mawps), env (held-out prompts of env.path's "
                                  "make_prompts: the task a run trained on), or {name, path, prompt_key, answer_key, "
                                  "answer_extract, env, suffix, generate} entries (a known name fills the rest).")
    data_dir: str = opt("", "where the named sets live; empty: the package's own copy (sparserl/data/eval)")
    n: int = opt(1, "samples per prompt (> 1 needs eval.temperature > 0)", rule=COUNT)
    k: list[int] = opt([1], "pass@k for each k (1 <= k <= n)", rule=each(COUNT, min_len=1))
    temperature: float = opt(0.0, "0 = greedy", rule=NON_NEG)
    top_p: float = opt(1.0, rule=within("(0, 1]"))
    max_new_tokens: int = opt(512, rule=COUNT)
    limit: int = opt(0, "the first `limit` prompts of each set; 0 = all", rule=NON_NEG)
    seed: int = opt(0, "a sample's seed depends on (seed, dataset, prompt index, sample index) only", rule=NON_NEG)
    output_dir: str = opt("outputs/eval", "eval.json, samples.jsonl (training writes under "
                                          "trainer.output_dir/eval/)")


@dataclass
class WandbConfig:
    mode: str = opt("disabled", "disabled | offline | online", choices=("disabled", "offline", "online"))
    project: str = opt("sparserl", "wandb project", rule=NON_EMPTY)
    name: str | None = opt(None, "wandb run name; null = wandb's choice")


@dataclass
class LoggerConfig:
    progress: bool = opt(True, "progress bars on rank 0 where stderr is a terminal (SPARSERL_PROGRESS=0/1 "
                               "overrides)")
    wandb: WandbConfig = opt(WandbConfig)


@dataclass
class RMConfig:
    """`python -m sparserl.trainer.rm` (docs/rm.md): pairs from data.train_path (`prompt`, `chosen`, `rejected`)."""

    eval_path: str = opt("", "held-out pairs for the pairwise accuracy; empty: the shipped "
                             "data/preference/math_pairs_test.jsonl when data.train_path is empty too (the shipped "
                             "training pairs), else none")
    eval_every: int = opt(0, "evaluate on the held-out pairs every this many steps (and before the first and after "
                             "the last); 0 = before and after only", rule=NON_NEG)
    eval_limit: int = opt(0, "the first this many held-out pairs; 0 = all", rule=NON_NEG)
    max_length: int = opt(1024, "pairs with a sequence (prompt + response) longer than this many tokens are skipped",
                          rule=COUNT)


@dataclass
class DPOConfig(RMConfig):
    """`python -m sparserl.trainer.dpo` (docs/dpo.md); the eval/length keys as rm.*."""

    loss: str = opt("sigmoid", "sigmoid (DPO) | ipo", choices=("sigmoid", "ipo"))
    beta: float = opt(0.1, "the KL strength: DPO's logit scale, IPO's target margin 1 / (2 beta)", rule=above(0))


@dataclass
class Config:
    model: ModelConfig = opt(ModelConfig)
    data: DataConfig = opt(DataConfig)
    env: EnvConfig = opt(EnvConfig)
    rollout: RolloutConfig = opt(RolloutConfig)
    actor: ActorConfig = opt(ActorConfig)
    algo: AlgoConfig = opt(AlgoConfig)
    critic: CriticConfig = opt(CriticConfig, "A value model trained beside the actor (algo.adv_estimator=gae); "
                                             "sparserl/config/critic.py.")
    parallel: ParallelConfig = opt(ParallelConfig)
    trainer: TrainerConfig = opt(TrainerConfig)
    eval: EvalConfig = opt(EvalConfig, "`python -m sparserl.eval` and evaluation during training "
                                       "(trainer.eval_every); see sparserl/eval/.")
    logger: LoggerConfig = opt(LoggerConfig)
    rm: RMConfig = opt(RMConfig, "`python -m sparserl.trainer.rm`: the reward model's pairs (docs/rm.md).")
    dpo: DPOConfig = opt(DPOConfig, "`python -m sparserl.trainer.dpo`: the loss and its pairs (docs/dpo.md).")


def base_configs() -> list[str]:
    """The names `--config-name` accepts: the YAML files directly in the config folder."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# The first line of an SFT run's config.yaml. The file has the GRPO trainer's keys (one schema), but such a run sampled
# nothing: `python -m sparserl.eval` takes no sampling setting from it (sparserl/eval/run_settings.py).
SFT_CONFIG_HEADER = "# sparserl.trainer.sft: trained on fixed targets; the rollout.* keys below were not used\n"
RM_CONFIG_HEADER = "# sparserl.trainer.rm: a reward model trained on preference pairs; the rollout.* keys below were not used\n"
DPO_CONFIG_HEADER = "# sparserl.trainer.dpo: trained on preference pairs; the rollout.* keys below were not used\n"


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
