"""Which weights `python -m sparserl.eval` evaluates: `model.path` -> a Hugging Face checkpoint, maybe plus DCP.

`model.path` may be anything the trainer takes (a Hugging Face folder, a hub id, the offline alias
`smollm2-135m-instruct`), a training run's `trainer.output_dir` (its exported `hf/`, or, before the export,
its latest complete checkpoint), or one DCP checkpoint folder `checkpoints/step_N/`. A DCP checkpoint holds
only tensors: the architecture and tokenizer come from the run's own `model.path` (its `config.yaml`), and
the checkpoint's model weights are pushed into the rollout engine through `update_weights`, as after a
training step.
Left out on purpose: LoRA adapters and merging, checkpoints of other trainers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from sparserl.actor import checkpoint
from sparserl.actor.hf import resolve_model_path
from sparserl.utils.errors import UserError


@dataclass
class EvalModel:
    path: str  # Hugging Face checkpoint: architecture, tokenizer, and the weights unless `dcp` is set
    dcp: Path | None = None  # a sparserl DCP checkpoint whose model weights replace them

    def describe(self) -> str:
        return str(self.dcp) if self.dcp is not None else self.path


def _run_base_model(run_dir: Path, given: str) -> str:
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise UserError(f"model.path={given}: a checkpoint folder, but {cfg_file} (the run's config, which names its "
                        "base model) is missing")
    from omegaconf import OmegaConf

    base = OmegaConf.load(cfg_file).get("model", {}).get("path")
    if not base:
        raise UserError(f"model.path={given}: {cfg_file} has no model.path")
    return resolve_model_path(str(base))


def resolve_eval_model(path: str) -> EvalModel:
    """See the module docstring; raises UserError (or FileNotFoundError) naming model.path."""
    p = Path(path).expanduser()
    if p.is_dir() and not (p / "config.json").exists():
        if (p / "hf" / "config.json").exists():
            return EvalModel(str(p / "hf"))
        if (p / "COMPLETE").exists():  # checkpoints/step_N/ of a run
            return EvalModel(_run_base_model(p.parent.parent, path), p)
        latest = checkpoint.latest(p)
        if latest is not None:
            return EvalModel(_run_base_model(p, path), latest)
        if (p / "checkpoints").exists() or (p / "metrics.jsonl").exists():
            raise UserError(f"model.path={path}: a training run without an exported hf/ or a complete checkpoint")
    return EvalModel(resolve_model_path(path))


def load_dcp_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The model tensors of a sparserl DCP checkpoint as full (unsharded) CPU tensors, by parameter name."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {}
    for key, m in meta.items():
        if key.startswith("model.") and hasattr(m, "size"):
            state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not state:
        raise UserError(f"model.path={path}: the checkpoint holds no model tensors")
    dcp.load(state, checkpoint_id=str(path))
    for key, tensor in state.items():
        yield key.removeprefix("model."), tensor
