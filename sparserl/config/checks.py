"""Every check of a whole config, and the table of every key's rule.

Where a rule comes from: each field declares its own (`opt(..., choices=...)` for an enum, `opt(..., rule=...)`
otherwise; sparserl/config/fields.py), in sparserl/config/schema.py and in the config groups of sparserl/kv/ and
sparserl/algo/; a rule relating two keys of one group is in its class's `RELATIONS`, one relating keys of
different groups in `CROSS_CHECKS` (sparserl/config/relations.py). `RULES` maps every checked key of the schema
to its `Rule`, a test and its wording (`> 0`, `in [0, 1)`, `one of none, rkv, ...`), which `--help` and
docs/config.md print; `RANGES` is the part that is not an enum; `FREE` lists the keys that take any value of
their type. tests/process/test_bad_inputs.py keeps the enums equal to their registries and checks that every key of
the schema has a rule or is listed in `FREE`.

`check_config(cfg)` checks every group (`check_section`: its field types, its rules, its relations), then the
cross-checks. A failed check is one `ConfigError` naming the key, the value and what is valid, raised before
torch is imported or anything is written. Names that live in registries next to torch or numpy code (KV policies,
estimators, losses, dtypes, wandb modes, answer extractors) are declared with their fields so that a bad key costs
no heavy import. KV policies registered at run time (`sparserl.kv.register_policy`) pass too:
`rollout.kv.algorithm` also looks in that registry, where it has been loaded.

Left out on purpose: checks that need the filesystem, the world size, an installed package or a model
(`trainer/preflight.py`, the SGLang backend's `check_config` and the code that meets them do those), `eval.k`
the eval sets (sparserl/eval/datasets.py), and type errors on the command line (OmegaConf
rejects `actor.lr=abc` while composing; `check_section` repeats the type check for dataclasses built in code).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sparserl.config.fields import Rule, check_section, hints, rule_of
from sparserl.config.relations import CROSS_CHECKS
from sparserl.config.schema import Config

# Keys that take any value of their type: paths, field names, free text, switches.
FREE = ("model.path", "model.activation_checkpointing", "model.allow_pickle_weights", "data.train_path", "data.system_prompt", "data.shuffle",
        "env.path", "env.openreward.envs", "env.openreward.base_url", "env.openreward.serve", "rollout.release_weights", "rollout.quantize_lm_head", "rollout.kv.compress_prompt",
        "rollout.sglang.attention_backend", "rollout.sglang.memory_saver", "rollout.sglang.log_level",
        "actor.balance_ranks", "actor.fuse_old_logprobs", "actor.share_prompts", "actor.skip_zero_advantage", "algo.correction.enable", "algo.correction.is_batch_normalize",
        "algo.correction.apply_to_kl", "algo.correction.rejected_in_baseline",
        "actor.lora.export_merged", "algo.dynamic_sampling.enable", "algo.overlong.mask", "trainer.export_hf", "trainer.overwrite", "eval.datasets",
        "eval.data_dir", "eval.output_dir", "logger.progress", "logger.wandb.name", "critic.enable", "critic.model_path",
        "rollout.partial.enable", "rm.eval_path", "dpo.eval_path",
        "env.reward_model.path")


def groups(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted prefix, dataclass) of `node` and of every group under it, depth first in field order."""
    out = [(prefix, node)]
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out += groups(value, f"{prefix}.{f.name}" if prefix else f.name)
    return out


def check_config(cfg: Config) -> None:
    """Raise a ConfigError for the first value outside its rule (group by group, in schema order), then for the
    first failed cross-group check."""
    for prefix, node in groups(cfg):
        check_section(prefix, node)
    for check in CROSS_CHECKS:
        check(cfg)


def _schema_rules(cls: type, prefix: str, out: dict[str, tuple[Rule, bool]]) -> None:
    types_ = hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = (f"{prefix}.{f.name}" if prefix else f.name), types_[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            _schema_rules(hint, key, out)
        elif (rule := rule_of(f, hint)) is not None:
            out[key] = (rule, "rule" in f.metadata)


_ALL: dict[str, tuple[Rule, bool]] = {}
_schema_rules(Config, "", _ALL)
# Every checked key of the schema and its rule, in schema order; RANGES: those declared with `rule=` (not enums).
RULES: dict[str, Rule] = {key: rule for key, (rule, _) in _ALL.items()}
RANGES: dict[str, Rule] = {key: rule for key, (rule, declared) in _ALL.items() if declared}
