"""What the chosen engine needs of this machine, checked with the other inputs before anything is written or torch
is imported (training: trainer/preflight.py; evaluation: eval/__main__.py).

Left out on purpose: the config's values (sparserl/config/ checks those when the config loads).
"""
from __future__ import annotations

from sparserl.config import Config


def check_engine(cfg: Config) -> None:
    """A one-line UserError when `rollout.engine` cannot run here with these settings."""
    if cfg.rollout.engine == "sglang":
        from sparserl.engines.sglang import check_available  # imports no sglang: it says when sglang is missing

        check_available(kv_algorithm=cfg.rollout.kv.algorithm, quantization=cfg.rollout.quantization)
