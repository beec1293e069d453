"""The base configs: configs/gpu.yaml (the Sparse-RL paper's GPU settings) composes and passes every config check on
a machine without a GPU, and `--config-name` selects a base config on every entry point (the command line and the
recipe scripts in fresh processes: tests/process/test_recipes.py). The schema holds every default
(configs/grpo.yaml sets none), a renamed key in a YAML names its replacement, and the config dataclasses the
library builds raise the command line's errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sparserl.algo import CorrectionConfig
from sparserl.cli import parse_cli
from sparserl.config import base_configs
from sparserl.config.load import load_config
from sparserl.config.fields import ConfigError
from sparserl.kv import KVPolicyConfig
from sparserl.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PAPER = {"rollout.n": 8, "rollout.max_new_tokens": 4096, "rollout.temperature": 1.0, "rollout.dtype": "bfloat16",
         "model.compute_dtype": "bfloat16", "actor.lr": 1e-6, "actor.betas": [0.9, 0.98], "actor.weight_decay": 0.1,
         "actor.updates_per_rollout": 4, "algo.kl.coef": 1e-4, "algo.kl.estimator": "k3", "algo.kl.mode": "loss",
         "algo.clip_low": 0.2, "algo.clip_high": 0.2, "algo.loss_agg": "sequence", "rollout.kv.budget": 512,
         "rollout.kv.divide_length": 128, "rollout.kv.window": 8, "rollout.kv.mix_lambda": 0.1,
         "trainer.prompts_per_step": 128, "trainer.total_steps": 100, "env.path": "envs/math.py", "data.answer_key": "label"}


def get(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_gpu_config_is_a_base_config_and_validates_without_a_gpu():
    assert {"grpo", "eval", "gpu"} <= set(base_configs())
    cfg = load_config([], config_name="gpu")  # runs every range and cross-key check
    assert cfg.rollout.kv.algorithm == "none" and not cfg.algo.correction.enable  # the mode comes from a preset
    sparse = load_config(["+preset=sparse_rl", "actor.lr=2e-6"], config_name="gpu")
    assert sparse.rollout.kv.algorithm == "rkv" and sparse.algo.correction.enable and sparse.actor.lr == 2e-6
    assert sparse.rollout.max_new_tokens == 4096 and sparse.trainer.prompts_per_step == 128
    # The sparse presets select as Sparse-RL's rollouts do: the reference code's R-KV scores, one set per layer.
    for preset in ("sparse_rl", "naive_sparse"):
        kv = load_config([f"+preset={preset}"], config_name="gpu").rollout.kv
        assert (kv.algorithm, kv.variant, kv.share) == ("rkv", "reference", "layer"), preset
    head = load_config(["+preset=sparse_rl", "rollout.engine=sglang", "parallel.tp=2", "rollout.kv.share=head"])
    assert head.rollout.kv.share == "head"  # SGLang with TP keeps per-head sets (each rank holds whole KV heads)


@pytest.mark.parametrize("option", [["--config-name", "gpu"], ["--config-name=gpu"], ["-cn", "gpu"]])
def test_config_name_forms(option, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert parse_cli(option + ["--cfg", "job", "rollout.n=4"]) is None
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rollout"]["n"] == 4 and cfg["rollout"]["max_new_tokens"] == 4096
    assert parse_cli(option + ["--help"], "eval") is None  # any entry point
    text = capsys.readouterr().out
    assert "the values shown are configs/gpu.yaml's" in text and "rollout.max_new_tokens = 4096" in text


def test_unknown_config_name_names_the_base_configs():
    with pytest.raises(UserError, match=r"--config-name gpus: no such base config; the base configs are eval, gpu, grpo"):
        parse_cli(["--config-name", "gpus"])
    with pytest.raises(UserError, match="--config-name [(]nothing[)]"):
        parse_cli(["--config-name"])


def test_the_dataclasses_hold_every_default_and_grpo_yaml_sets_none():
    """configs/grpo.yaml only names the schema: a training run's defaults are the dataclasses' (sparserl/config/schema.py),
    so the YAML and the dataclasses cannot disagree."""
    from sparserl.config import CONFIG_DIR, Config

    assert yaml.safe_load((CONFIG_DIR / "grpo.yaml").read_text()) == {"defaults": ["sparserl_schema", "_self_"]}
    assert load_config([]) == Config()


def test_the_schema_has_180_leaf_keys(capsys):
    from sparserl.config.load import leaf_keys

    keys = leaf_keys()
    with capsys.disabled():
        print(f"\nconfig leaf keys: {len(keys)}")
    assert len(keys) == len(set(keys)) == 180  # 176 before env.reward_model.* (3) and parallel.dp_replicate; 162 before critic.*, algo.gamma, algo.lam (10) and rollout.partial.* (4); 152 before rm.* and dpo.*; 151 before rollout.kv_dtype; 148 before trainer.overwrite, rollout.kv_memory and rollout.admission; 147 before actor.skip_zero_advantage; 146 before rollout.prepack; 145 before algo.correction.rescue_group_frac; 144 before rollout.kv.control.statistic; 143 before parallel.cp; 142 before algo.correction.rescue; 135 before rollout.kv.control; 125 before actor.lora, algo.dynamic_sampling and algo.overlong; 129 before the four rollout.sglang.* duplicates were folded


def test_a_renamed_key_in_a_yaml_names_its_replacement(tmp_path):
    import shutil

    from sparserl.config import CONFIG_DIR

    folder = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, folder)
    (folder / "preset" / "old.yaml").write_text("# @package _global_\nrollout:\n  sglang:\n    max_total_tokens: 4096\n")
    (folder / "old.yaml").write_text("defaults:\n  - sparserl_schema\n  - _self_\nrollout:\n  sglang:\n    dtype: bfloat16\n")
    with pytest.raises(UserError, match=r"^rollout.sglang.max_total_tokens was folded into rollout.kv_pool_tokens "
                                        r"\(it sets both engines\); use rollout.kv_pool_tokens=...$"):
        load_config(["+preset=old"], config_dir=folder)
    with pytest.raises(UserError, match=r"^rollout.sglang.dtype was folded into rollout.dtype"):
        load_config([], config_name="old", config_dir=folder)


@pytest.mark.parametrize("overrides, build", [
    (["rollout.kv.kernel=4"], lambda: KVPolicyConfig(kernel=4)),
    (["rollout.kv.budget=8"], lambda: KVPolicyConfig(budget=8)),
    (["algo.correction.mode=log"], lambda: CorrectionConfig(mode="log")),
    (["algo.correction.geo_low=2", "algo.correction.geo_high=1"], lambda: CorrectionConfig(geo_low=2.0, geo_high=1.0)),
])
def test_config_dataclasses_built_in_code_raise_what_the_command_line_does(overrides, build):
    """rollout.kv is KVPolicyConfig and algo.correction is CorrectionConfig: one set of checks, one wording, a
    ValueError for library callers and a UserError for the entry points."""
    with pytest.raises(ConfigError) as built:
        build()
    assert isinstance(built.value, ValueError) and isinstance(built.value, UserError)
    with pytest.raises(UserError) as loaded:
        load_config(overrides)
    assert str(built.value) == str(loaded.value)
