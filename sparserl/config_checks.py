"""What each config value may be, and every check of a config value: the one place a value is validated.

Where a rule comes from:
- an enum's valid names are declared with its field (`opt(..., choices=...)`, sparserl/config.py and the
  config dataclasses of sparserl/kv/policy.py and sparserl/algo/correction_config.py); `rule_for` turns them
  into a `one_of` rule (each element of a list field must be one of them);
- `RANGES` holds every other rule by key, written by hand: numeric ranges, non-empty strings, list shapes;
- `SECTION_CHECKS` (sparserl/config_relations.py) relate two keys of one group (a KV budget larger than its window, a low bound below its high
  bound), `CROSS_CHECKS` keys of different groups.
`RULES` (built on first use from the schema) maps every checked key to its `Rule`, a test and its wording
(`> 0`, `in [0, 1)`, `one of none, rkv, ...`); `--help` and docs/config.md print the same wording.

`check_section(prefix, node)` checks the values of one group (its field types, its rules, its section checks)
and `check_config(cfg)` every group, then the cross-checks. The config dataclasses that library code builds on
its own (`KVPolicyConfig`, `CorrectionConfig`) call `check_section` from `__post_init__`, so a bad value raises
the same error there as on the command line. A failed check is one `ConfigError` (a `UserError`, so the entry
points print it as one `error:` line; and a `ValueError`, for library callers) naming the key, the value and
what is valid, raised before torch is imported or anything is written. Names that live in registries next to
torch or numpy code (KV policies, estimators, losses, dtypes, wandb modes, answer extractors) are declared with
their fields so that a bad key costs no heavy import; tests/unit/test_bad_inputs.py keeps each list equal to its
registry and checks that every key of the schema has a rule or is listed in `FREE`. KV policies registered at
run time (`sparserl.kv.register_policy`) pass too: `rollout.kv.algorithm` also looks in that registry, where
it has been loaded.

Left out on purpose: checks that need the filesystem, the world size, an installed package or a model
(`trainer/preflight.py`, the SGLang backend's `check_config` and the code that meets them do those), `eval.k`
the eval sets (sparserl/eval/datasets.py), and type errors on the command line (OmegaConf
rejects `actor.lr=abc` while composing; `check_section` repeats the type check for dataclasses built in code).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sparserl.utils.errors import UserError

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64")  # actor/hf.py DTYPES
# `opt(..., **DTYPES)`: a dtype key's valid names and how --help words them.
DTYPES = {"choices": DTYPE_NAMES, "choices_desc": "float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)"}
AUTO_DTYPES = {"choices": ("auto", *DTYPE_NAMES),
               "choices_desc": "auto, float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)"}


class ConfigError(UserError, ValueError):
    """A config value outside its rule: one line naming the key, the value and what is valid."""


def opt(default: Any, help: str = "", *, choices: Iterable[str] = (), choices_desc: str = "") -> Any:
    """A schema field: its default, its `--help` text and, for an enum, its valid names (`choices`, worded as
    `choices_desc` where "one of a, b, c" would not read well). A mutable default (a list, a dict, a dataclass
    instance) is copied for every instance; a dataclass type is instantiated."""
    metadata = {"help": help}
    if choices:
        metadata["choices"] = tuple(choices)
        if choices_desc:
            metadata["choices_desc"] = choices_desc
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any], bool]
    desc: str  # completes "must be ..."
    names: tuple[str, ...] = ()  # the valid names of an enum (--help omits `desc` where the help text lists them)
    more: Callable[[], tuple[str, ...]] | None = None  # names registered at run time that pass as well

    def ok(self, value: Any) -> bool:
        return self.test(value) or (self.more is not None and isinstance(value, str) and value in self.more())

    def describe(self) -> str:
        extra = [n for n in (self.more() if self.more else ()) if n not in self.names]
        return f"one of {', '.join((*self.names, *extra))}" if extra else self.desc


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


def one_of(*names: str, desc: str = "", more: Callable[[], tuple[str, ...]] | None = None) -> Rule:
    return Rule(lambda v: isinstance(v, str) and v in names, desc or f"one of {', '.join(names)}", names, more)


def or_null(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), f"{rule.desc}, or null (off)")


def each(rule: Rule, length: int | None = None, min_len: int = 0) -> Rule:
    size = f"{length} values" if length is not None else ("a non-empty list" if min_len else "a list")
    return Rule(lambda v: isinstance(v, (list, tuple)) and (len(v) == length if length is not None else len(v) >= min_len)
                and all(rule.test(x) for x in v), f"{size}, each {rule.desc}")


NON_EMPTY = Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
ODD = Rule(lambda v: _finite(v) and v >= 1 and v % 2 == 1, "an odd integer >= 1 (even kernels shift the pooled scores)")
COUNT, NON_NEG, PROB = at_least(1), at_least(0), within("[0, 1]")

# Every rule that is not an enum (enums are declared with their fields).
RANGES: dict[str, Rule] = {
    "data.prompt_key": NON_EMPTY,
    "data.answer_key": NON_EMPTY,
    "data.messages_key": NON_EMPTY,
    "data.num_generated": COUNT,
    "data.max_prompt_tokens": COUNT,
    "env.max_turns": COUNT,
    "env.step_timeout_s": NON_NEG,
    "env.max_concurrency": COUNT,
    "env.openreward.api_key_env": NON_EMPTY,
    "rollout.n": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": NON_NEG,
    "rollout.top_p": within("(0, 1]"),
    "rollout.top_k": NON_NEG,
    "rollout.stop_strings": each(NON_EMPTY),
    "rollout.kv_pool_tokens": NON_NEG,
    "rollout.max_num_seqs": COUNT,
    "rollout.max_batch_tokens": COUNT,
    "rollout.rescore_seqs": NON_NEG,
    "rollout.kv.budget": Rule(lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                              "an integer >= 1 or auto"),
    "rollout.kv.divide_length": COUNT,
    "rollout.kv.window": COUNT,
    "rollout.kv.mix_lambda": PROB,
    "rollout.kv.kernel": ODD,
    "rollout.kv.sim_threshold": within("[-1, 1]"),
    "rollout.kv.sinks": NON_NEG,
    "rollout.kv.control.floor": COUNT,
    "rollout.kv.control.ceiling": COUNT,
    "rollout.kv.control.target": within("(0, 1]"),
    "rollout.kv.control.hysteresis": NON_NEG,
    "rollout.kv.control.factor": above(1),
    "rollout.kv.control.patience": COUNT,
    "rollout.kv.control.align": COUNT,
    "rollout.sglang.mem_fraction_static": within("(0, 1)"),
    "rollout.sglang.chunked_prefill_size": NON_NEG,
    "rollout.sglang.weight_bucket_mb": above(0),
    "actor.lr": NON_NEG,
    "actor.weight_decay": NON_NEG,
    "actor.betas": each(within("[0, 1)"), length=2),
    "actor.warmup_steps": NON_NEG,
    "actor.min_lr_ratio": PROB,
    "actor.max_grad_norm": above(0),
    "actor.max_tokens_per_device": COUNT,
    "actor.logprob_chunk_mb": NON_NEG,
    "actor.updates_per_rollout": COUNT,
    "actor.ppo_epochs": COUNT,
    "actor.lora.rank": NON_NEG,
    "actor.lora.alpha": above(0),
    "actor.lora.dropout": within("[0, 1)"),
    "actor.lora.target_modules": each(NON_EMPTY, min_len=1),
    "algo.clip_low": within("[0, 1)"),
    "algo.clip_high": NON_NEG,
    "algo.dual_clip": or_null(above(1)),
    "algo.entropy_coef": NON_NEG,
    "algo.kl.coef": NON_NEG,
    "algo.dynamic_sampling.max_rounds": COUNT,
    "algo.overlong.penalty": NON_NEG,
    "algo.overlong.buffer": COUNT,
    "algo.correction.is_cap": or_null(NON_NEG),
    "algo.correction.veto": or_null(NON_NEG),
    "algo.correction.token_low": or_null(NON_NEG),
    "algo.correction.token_high": or_null(NON_NEG),
    "algo.correction.geo_low": or_null(NON_NEG),
    "algo.correction.geo_high": or_null(NON_NEG),
    "algo.correction.rescue_group_frac": PROB,
    "parallel.tp": COUNT,
    "parallel.cp": COUNT,
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
    "eval.n": COUNT,
    "eval.k": each(COUNT, min_len=1),
    "eval.temperature": NON_NEG,
    "eval.top_p": within("(0, 1]"),
    "eval.max_new_tokens": COUNT,
    "eval.limit": NON_NEG,
    "eval.seed": NON_NEG,
    "logger.wandb.project": NON_EMPTY,
}

# Keys that take any value of their type: paths, field names, free text, switches.
FREE = ("model.path", "model.activation_checkpointing", "model.allow_pickle_weights", "data.train_path", "data.system_prompt", "data.shuffle",
        "env.path", "env.openreward.envs", "env.openreward.base_url", "env.openreward.serve", "rollout.release_weights", "rollout.quantize_lm_head", "rollout.kv.compress_prompt",
        "rollout.sglang.attention_backend", "rollout.sglang.cuda_graph", "rollout.sglang.memory_saver", "rollout.sglang.log_level",
        "actor.balance_ranks", "actor.fuse_old_logprobs", "actor.share_prompts", "actor.skip_zero_advantage", "algo.correction.enable", "algo.correction.is_batch_normalize",
        "algo.correction.apply_to_kl", "algo.correction.rejected_in_baseline",
        "actor.lora.export_merged", "algo.dynamic_sampling.enable", "algo.overlong.mask", "trainer.export_hf", "eval.datasets",
        "eval.data_dir", "eval.output_dir", "logger.progress", "logger.wandb.name")


def _registered_policies() -> tuple[str, ...]:
    """KV policies in sparserl.kv's registry; where it is not loaded, no policy can have been registered."""
    base = sys.modules.get("sparserl.kv.base")
    return tuple(getattr(base, "POLICIES", ())) if base is not None else ()


# Enum keys whose registry can grow at run time, and where to look.
RUNTIME_NAMES: dict[str, Callable[[], tuple[str, ...]]] = {"rollout.kv.algorithm": _registered_policies}


def _is_list(hint: Any) -> bool:
    return typing.get_origin(hint) is list


def rule_for(key: str, f: dataclasses.Field, hint: Any = None) -> Rule | None:
    """The rule of schema field `f` at dotted `key`: its hand-written range, else its declared enum names."""
    if key in RANGES:
        return RANGES[key]
    names = f.metadata.get("choices")
    if not names:
        return None
    rule = one_of(*names, desc=f.metadata.get("choices_desc", ""), more=RUNTIME_NAMES.get(key))
    return each(rule) if _is_list(hint) else rule


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    name = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint)
    return name or {list: "a list", dict: "a map"}.get(typing.get_origin(hint), str(hint))


def get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, str):
        return value if value else "''"
    return json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)


def check_section(prefix: str, node: Any) -> None:
    """Raise a ConfigError for the first leaf of dataclass `node` (the group at dotted `prefix`) of the wrong type
    or outside its rule, then for the first failed check of the group's SECTION_CHECKS. Nested groups are not
    visited (check_config visits every group)."""
    hints = _hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        hint = hints.get(f.name)
        if hint is not None and not _type_ok(value, hint):
            raise ConfigError(f"{key}={show(value)}: must be {_type_name(hint)}")
        rule = rule_for(key, f, hint)
        if rule is not None and not rule.ok(value):
            finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            raise ConfigError(f"{key}={show(value)}: must be {finite}{rule.describe()}")
    from sparserl.config_relations import SECTION_CHECKS  # it imports this module

    for check in SECTION_CHECKS.get(prefix, ()):
        check(node, prefix)


def groups(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted prefix, dataclass) of `node` and of every group under it, depth first in field order."""
    out = [(prefix, node)]
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out += groups(value, f"{prefix}.{f.name}" if prefix else f.name)
    return out


def check_config(cfg: Any) -> None:
    """Raise a ConfigError for the first value outside its rule (group by group, in schema order), then for the
    first failed cross-group check."""
    from sparserl.config_relations import CROSS_CHECKS  # it imports this module

    for prefix, node in groups(cfg):
        check_section(prefix, node)
    for check in CROSS_CHECKS:
        check(cfg)


def _schema_rules(cls: type, prefix: str, out: dict[str, Rule]) -> None:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = (f"{prefix}.{f.name}" if prefix else f.name), hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            _schema_rules(hint, key, out)
        elif (rule := rule_for(key, f, hint)) is not None:
            out[key] = rule


@functools.cache
def rules() -> dict[str, Rule]:
    """Every checked key of the schema (sparserl/config.py `Config`) and its rule, in schema order."""
    from sparserl.config import Config

    out: dict[str, Rule] = {}
    _schema_rules(Config, "", out)
    return out


def __getattr__(name: str) -> Any:
    if name == "RULES":  # built on first use: the schema imports this module
        return rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
