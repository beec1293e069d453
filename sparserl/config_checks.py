"""What each config value may be, as data, and the check `load_config` runs on a freshly loaded config.

`RULES` maps every numeric and enum key to a `Rule` (a test and its wording: `> 0`, `in [0, 1)`, `one of
none, rkv, ...`); `CROSS_CHECKS` relate two keys (a KV budget larger than its window, a low bound below its
high bound). A failed check is one `UserError` naming the key, the value and what is valid, raised before
torch is imported or anything is written. `--help` prints the same wording. Names that live in registries next to
torch or numpy code (KV policies, estimators, losses, dtypes, wandb modes, answer extractors) are listed here
so that a bad key costs no heavy import; tests/unit/test_bad_inputs.py keeps each list equal to its registry
and checks that every key of the schema has a rule or is listed in `FREE`.

Left out on purpose: checks that need the filesystem, the world size or a model (`trainer/preflight.py`
and the code that meets them do those), `rollout.sglang.*` (the SGLang backend's `check_config` knows which
settings it can honour), `eval.k` against `eval.n` and the eval sets (sparserl/eval/datasets.py), names
registered by user code at run time (only the built-in names pass), and type errors (OmegaConf rejects
`actor.lr=abc` while composing).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from sparserl.utils.errors import UserError

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64")  # actor/hf.py DTYPES


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any], bool]
    desc: str  # completes "must be ..."
    names: tuple[str, ...] = ()  # the valid names of an enum (--help omits `desc` where the comment lists them)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at_least(lo: float) -> Rule:
    return Rule(lambda v: _finite(v) and v >= lo, f">= {lo}")


def above(lo: float) -> Rule:
    return Rule(lambda v: _finite(v) and v > lo, f"> {lo}")


def within(interval: str) -> Rule:
    """`within("(0, 1]")`: brackets say closed, parentheses open."""
    lo_s, hi_s = interval[1:-1].split(",")
    lo, hi, lo_open, hi_open = float(lo_s), float(hi_s), interval[0] == "(", interval[-1] == ")"
    return Rule(lambda v: _finite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi),
                f"in {interval}")


def one_of(*names: str, desc: str = "") -> Rule:
    return Rule(lambda v: v in names, desc or f"one of {', '.join(names)}", names)


def or_null(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), f"{rule.desc}, or null (off)")


def each(rule: Rule, length: int | None = None, min_len: int = 0) -> Rule:
    size = f"{length} values" if length is not None else ("a non-empty list" if min_len else "a list")
    return Rule(lambda v: isinstance(v, (list, tuple)) and (len(v) == length if length is not None else len(v) >= min_len)
                and all(rule.test(x) for x in v), f"{size}, each {rule.desc}")


NON_EMPTY = Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
ODD = Rule(lambda v: _finite(v) and v >= 1 and v % 2 == 1, "an odd integer >= 1 (even kernels shift the pooled scores)")
COUNT, NON_NEG, PROB = at_least(1), at_least(0), within("[0, 1]")
DTYPE = one_of(*DTYPE_NAMES, desc="float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)")
AUTO_DTYPE = one_of("auto", *DTYPE_NAMES, desc="auto, float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)")

RULES: dict[str, Rule] = {
    "model.dtype": DTYPE,
    "model.compute_dtype": AUTO_DTYPE,
    "data.prompt_key": NON_EMPTY,
    "data.answer_key": NON_EMPTY,
    "data.messages_key": NON_EMPTY,
    "data.answer_extract": one_of("none", "gsm8k_hash", "boxed"),
    "data.apply_chat_template": one_of("auto", "always", "never"),
    "data.num_generated": COUNT,
    "data.max_prompt_tokens": COUNT,
    "env.max_turns": COUNT,
    "env.step_timeout_s": NON_NEG,
    "env.max_concurrency": COUNT,
    "env.openreward.api_key_env": NON_EMPTY,
    "env.openreward.tool_parser": one_of("hermes", "mistral", "llama3_json"),
    "rollout.engine": one_of("native", "sglang"),
    "rollout.n": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": NON_NEG,
    "rollout.top_p": within("(0, 1]"),
    "rollout.top_k": NON_NEG,
    "rollout.stop_strings": each(NON_EMPTY),
    "rollout.dtype": AUTO_DTYPE,
    "rollout.kv_pool_tokens": NON_NEG,
    "rollout.max_num_seqs": COUNT,
    "rollout.max_batch_tokens": COUNT,
    "rollout.quantization": one_of("none", "int8", "w8a8", "fp8"),
    "rollout.decode_cache": one_of("auto", "on", "off"),
    "rollout.rescore_seqs": NON_NEG,
    "rollout.kv.algorithm": one_of("none", "rkv", "snapkv", "streaming"),
    "rollout.kv.budget": COUNT,
    "rollout.kv.divide_method": one_of("step_length", "newline"),
    "rollout.kv.divide_length": COUNT,
    "rollout.kv.window": COUNT,
    "rollout.kv.mix_lambda": PROB,
    "rollout.kv.kernel": ODD,
    "rollout.kv.sim_threshold": within("[-1, 1]"),
    "rollout.kv.sinks": NON_NEG,
    "rollout.kv.share": one_of("head", "layer", "all"),
    "rollout.kv.variant": one_of("paper", "reference"),
    "actor.lr": NON_NEG,
    "actor.weight_decay": NON_NEG,
    "actor.betas": each(within("[0, 1)"), length=2),
    "actor.lr_schedule": one_of("constant", "cosine"),
    "actor.warmup_steps": NON_NEG,
    "actor.min_lr_ratio": PROB,
    "actor.max_grad_norm": above(0),
    "actor.max_tokens_per_device": COUNT,
    "actor.logprob_chunk_mb": NON_NEG,
    "actor.updates_per_rollout": COUNT,
    "actor.ppo_epochs": COUNT,
    "algo.adv_estimator": one_of("grpo", "drgrpo"),
    "algo.loss_agg": one_of("token", "sequence"),
    "algo.policy_loss": one_of("ppo", "cispo"),
    "algo.clip_low": within("[0, 1)"),
    "algo.clip_high": NON_NEG,
    "algo.dual_clip": or_null(above(1)),
    "algo.entropy_coef": NON_NEG,
    "algo.kl.coef": NON_NEG,
    "algo.kl.estimator": one_of("k1", "k2", "k3", "kl", "mse", "low_var_kl"),
    "algo.kl.mode": one_of("loss", "reward"),
    "algo.correction.mode": one_of("apply", "measure"),
    "algo.correction.is_cap": or_null(NON_NEG),
    "algo.correction.normalize_over": one_of("kept", "all"),
    "algo.correction.veto": or_null(NON_NEG),
    "algo.correction.token_low": or_null(NON_NEG),
    "algo.correction.token_high": or_null(NON_NEG),
    "algo.correction.geo_low": or_null(NON_NEG),
    "algo.correction.geo_high": or_null(NON_NEG),
    "parallel.tp": COUNT,
    "parallel.backend": one_of("auto", "gloo", "nccl"),
    "parallel.device": one_of("auto", "cpu", "cuda"),
    "trainer.total_steps": COUNT,
    "trainer.prompts_per_step": COUNT,
    "trainer.output_dir": NON_EMPTY,
    "trainer.save_every": NON_NEG,
    "trainer.resume": Rule(lambda v: isinstance(v, str) and v.strip() != "", "none, auto or a checkpoint folder",
                           ("none", "auto")),
    "trainer.seed": NON_NEG,
    "trainer.stop_after": NON_NEG,
    "trainer.eval_every": NON_NEG,
    "trainer.log_samples": within("[0, 64]"),
    "trainer.keep_last": NON_NEG,
    "trainer.max_skipped_steps": COUNT,
    "trainer.preempt_signals": each(one_of("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")),
    "eval.n": COUNT,
    "eval.k": each(COUNT, min_len=1),
    "eval.temperature": NON_NEG,
    "eval.top_p": within("(0, 1]"),
    "eval.max_new_tokens": COUNT,
    "eval.limit": NON_NEG,
    "eval.seed": NON_NEG,
    "logger.wandb.mode": one_of("disabled", "offline", "online"),
    "logger.wandb.project": NON_EMPTY,
}

# Keys that take any value of their type: paths, field names, free text, switches.
FREE = ("model.path", "model.activation_checkpointing", "model.allow_pickle_weights", "data.train_path", "data.system_prompt", "data.shuffle",
        "env.path", "env.openreward.envs", "env.openreward.base_url", "env.openreward.serve", "rollout.release_weights", "rollout.quantize_lm_head", "rollout.kv.compress_prompt",
        "actor.balance_ranks", "actor.fuse_old_logprobs", "actor.share_prompts", "algo.correction.enable", "algo.correction.is_batch_normalize",
        "algo.correction.apply_to_kl", "algo.correction.rejected_in_baseline", "trainer.export_hf", "eval.datasets",
        "eval.data_dir", "eval.output_dir", "logger.progress", "logger.wandb.name")


def get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, str):
        return value if value else "''"
    return json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)


def _ordered(cfg, lo: str, hi: str) -> None:
    a, b = get(cfg, lo), get(cfg, hi)
    if a is not None and b is not None and a > b:
        raise UserError(f"{lo}={show(a)} must be <= {hi}={show(b)}")


def _kv_fits(cfg) -> None:
    kv = cfg.rollout.kv
    if kv.budget <= kv.window:
        raise UserError(f"rollout.kv.budget={kv.budget} must be > rollout.kv.window={kv.window} (the window alone would "
                        "fill the budget)")
    if kv.algorithm == "streaming" and kv.sinks > kv.budget - kv.window:
        raise UserError(f"rollout.kv.sinks={kv.sinks} must be <= rollout.kv.budget - rollout.kv.window "
                        f"({kv.budget - kv.window}) so that every sink fits")


def _correction_bounds(cfg) -> None:
    _ordered(cfg, "algo.correction.token_low", "algo.correction.token_high")
    _ordered(cfg, "algo.correction.geo_low", "algo.correction.geo_high")


def _dual_clip_is_ppo(cfg) -> None:
    if cfg.algo.dual_clip is not None and cfg.algo.policy_loss != "ppo":
        raise UserError(f"algo.dual_clip={show(cfg.algo.dual_clip)} is a PPO option; set algo.dual_clip=null with "
                        f"algo.policy_loss={cfg.algo.policy_loss}")


def _nccl_needs_cuda(cfg) -> None:
    if cfg.parallel.backend == "nccl" and cfg.parallel.device == "cpu":
        raise UserError("parallel.backend=nccl needs parallel.device=cuda (or auto on a GPU machine); use gloo on CPU")


def _quantization_device(cfg) -> None:
    # parallel.device=auto is checked again where the device is known (engines/native/quantize.py check_scheme).
    q = cfg.rollout.quantization
    if q in ("w8a8", "fp8") and cfg.parallel.device == "cpu":
        why = ("torch has no fast int8 x int8 matmul on CPU; use int8 (weight-only)" if q == "w8a8"
               else "fp8 weights need a GPU; use int8")
        raise UserError(f"rollout.quantization={q} is not supported with parallel.device=cpu: {why}")


def _openreward(cfg) -> None:
    from sparserl.rollout.openreward.spec import parse_envs  # plain Python: no SDK, no torch

    o = cfg.env.openreward
    specs = parse_envs(o.envs)
    if not specs and (o.serve or o.base_url):
        raise UserError(f"env.openreward.{'serve' if o.serve else 'base_url'} is set but env.openreward.envs is empty: "
                        "name the environments to train on (env.openreward.envs={Org/Name: {}})")
    if o.serve and o.base_url:
        raise UserError(f"env.openreward.serve={o.serve} and env.openreward.base_url={o.base_url}: give one (a served "
                        "file gets its own local URL)")
    if specs and cfg.data.train_path:
        raise UserError(f"data.train_path={cfg.data.train_path} and env.openreward.envs are both set: OpenReward tasks "
                        "are the prompts; clear one of them")


CROSS_CHECKS: tuple[Callable[[Any], None], ...] = (_kv_fits, _correction_bounds, _dual_clip_is_ppo, _nccl_needs_cuda,
                                                   _quantization_device, _openreward)


def check_config(cfg: Any) -> None:
    """Raise a UserError for the first value outside its rule, then for the first failed cross-key check."""
    for key, rule in RULES.items():
        value = get(cfg, key)
        if not rule.test(value):
            finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            raise UserError(f"{key}={show(value)}: must be {finite}{rule.desc}")
    for check in CROSS_CHECKS:
        check(cfg)
