"""The run's configuration: the schema with every default and help text (`schema.py`), the field declarations and
one-key rules it is written with (`fields.py`), the checks of a whole config (`checks.py`, `relations.py`) and
loading it from the YAML files and the command line (`load.py`).

`fields.py` is the leaf: it imports nothing of sparserl but `utils.errors`, so the library's own config groups
(`KVPolicyConfig` in sparserl/kv/policy.py, `CorrectionConfig` in sparserl/algo/correction_config.py) are declared
and checked with it without importing the schema that holds them. For that reason this package imports nothing
when it is imported: `from sparserl.config import Config` (any name of `schema.py`, and `load_config`) loads its
module on first use (importing `sparserl.config.fields` from sparserl.kv must not start the schema, which imports
sparserl.kv back).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparserl.config.load import load_config
    from sparserl.config.schema import (CONFIG_DIR, ActorConfig, AlgoConfig, Config, DataConfig, DynamicSamplingConfig,
                                        EnvConfig, EvalConfig, KLConfig, LoggerConfig, LoRAConfig, ModelConfig,
                                        OpenRewardConfig, OverlongConfig, ParallelConfig, RolloutConfig, SGLangConfig,
                                        SFT_CONFIG_HEADER, TrainerConfig, WandbConfig, base_configs, to_dict, to_yaml)

__all__ = ["CONFIG_DIR", "ActorConfig", "AlgoConfig", "Config", "DataConfig", "DynamicSamplingConfig", "EnvConfig",
           "EvalConfig", "KLConfig", "LoggerConfig", "LoRAConfig", "ModelConfig", "OpenRewardConfig", "OverlongConfig",
           "ParallelConfig", "RolloutConfig", "SGLangConfig", "SFT_CONFIG_HEADER", "TrainerConfig", "WandbConfig", "base_configs", "to_dict",
           "to_yaml", "load_config"]
_SCHEMA = frozenset(__all__) - {"load_config"}


def __getattr__(name: str) -> Any:
    if name in _SCHEMA:
        import sparserl.config.schema as schema

        return getattr(schema, name)
    if name == "load_config":
        import sparserl.config.load as load

        return load.load_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
