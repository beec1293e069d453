"""The SGLang rollout backend (`rollout.engine=sglang`): an in-process `sglang.Engine` per tensor-parallel group.

- `engine.py`: the adapter behind the engine contract of `engines/protocol.py` (registered as "sglang").
- `sampler_plugin.py`: the sampler SGLang runs in its scheduler process, so that `logp_sparse` is the processed
  distribution's log-prob and draws are seeded per sequence (loaded by SGLang through an entry point).
  The seeded draw itself is `sparserl/engines/draw.py`, shared with the native engine.
- `kv_backend.py`: the `sparserl_kv` attention backend and scheduler hooks SGLang loads (entry point) for KV
  compression that frees evicted slots; `kv_compactor.py` (triggers, and `sparserl/kv/compaction.py` mapped
  onto SGLang's pool), `kv_decode.py` (the decode step's static buffers, read by CUDA graphs) and `kv_records.py`
  (what the engine reads back) are pure torch / Python.

This package's `__init__` does not import sglang: `check_available` runs in the input validation of training and
evaluation (sparserl/engine_options/checks.py), before anything is written, also where sglang is absent.
"""
from __future__ import annotations

import importlib.util

from sparserl.utils.errors import UserError

INSTALL_HINT = 'pip install -e ".[sglang]" on a GPU machine, or bash scripts/install_sglang_cpu.sh for the CPU test venv'
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_VALUE = "sparserl.engines.sglang.sampler_plugin:register"
KV_PLUGIN_VALUE = "sparserl.engines.sglang.kv_backend:register"
SAMPLER_ENV_FLAG = "SPARSERL_SGLANG_SAMPLER"  # set for SGLang processes that must run sparserl's sampler
KV_ENV = "SPARSERL_SGLANG_KV"  # JSON policy / base backend for SGLang processes that compress (kv_backend.ENV)


def check_available(kv_algorithm: str = "none", quantization: str = "none") -> None:
    """What the SGLang engine needs of this machine and what it cannot run, as one line naming the key: SGLang
    installed, sparserl's plugins registered (the KV one when a KV policy is set), no quantized weights. Imports nothing
    heavy."""
    if importlib.util.find_spec("sglang") is None:
        raise UserError(f"rollout.engine=sglang needs SGLang, which is not installed: {INSTALL_HINT}")
    if not plugin_installed():
        raise UserError("rollout.engine=sglang: sparserl's SGLang sampler plugin is not registered; reinstall sparserl "
                        "(pip install -e .) so its sglang.srt.plugins entry point is recorded")
    if kv_algorithm != "none" and not plugin_installed(KV_PLUGIN_VALUE):
        raise UserError(f"rollout.kv.algorithm={kv_algorithm} with rollout.engine=sglang: sparserl's sparserl_kv plugin "
                        "is not registered; reinstall sparserl (pip install -e .) so its sglang.srt.plugins entry point is "
                        "recorded")
    if quantization != "none":
        # SGLang 0.5.23 loads update_weights_from_tensor through model.load_weights and never re-runs a quantization
        # method's post-load step, so an online-quantized (fp8) model would not be re-quantized by a weight sync.
        raise UserError(f"rollout.quantization={quantization}: quantized rollouts run in the native engine only "
                        "(SGLang 0.5.23 does not re-quantize weights pushed by update_weights_from_tensor); use "
                        "rollout.engine=native or rollout.quantization=none")


def plugin_installed(value: str = PLUGIN_VALUE) -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == value for ep in entry_points(group=PLUGIN_GROUP))
